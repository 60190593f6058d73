"""A team's own evaluator held to z-lab's loop: its calls recorded with no line added (recorder.py), rebuilt into
rounds per prompt (rounds.py), replayed through z-lab's `dflash_generate` (replay.py), each round's difference
localized (why.py), and its own τ named (tau.py); audit.py composes them."""
