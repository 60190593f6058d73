"""The shared base every verb and package stands on: the error type and input checks (exit 2, one line), JSON
lines, atomic writes, cache folders, the package-version table, placement (device, dtype, device map) and loading
a target. Nothing here knows what a drafter is; it imports no package of this repository but itself."""
