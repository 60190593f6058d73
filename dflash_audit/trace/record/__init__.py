"""Recording: the traced command launched in its own process group with the bootstrap first on its path
(launch.py, traced_process.py, bootstrap/), the recorder installed in each of its processes (recorder.py), and the
recording it leaves on disk (recording.py: one safetensors file and a manifest), with the marks that tell the verb
how far the command got (marks.py)."""
