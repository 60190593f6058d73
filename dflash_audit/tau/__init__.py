"""τ by a named method over benchmark prompt sets, at T = 0 or above, and the table of them (`eval --table`)."""
