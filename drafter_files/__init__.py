"""Our drafter's files: `ckpt.pt` as a `DraftSpec`, a `Recipe` and a body (checkpoint.py; the container is
foundation/ckpt_file.py), and z-lab's folder format (zlab_format.py), which the adapters, the held codebases, the
conformance world and the format readers all build from our settings. Above impl (they read its spec), below
everything that reads or writes a drafter on disk."""
