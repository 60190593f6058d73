"""The process Model-Optimizer runs in (`python -m held.modelopt_worker`, started by held/modelopt.py with the
interpreter of its own environment): reads a request frame (held/process_wire.py), runs the operation in
held/modelopt_ops.py, writes the answer frame. It holds the targets it was sent (by key) and the drafters it
built (by key, until the plug releases them). Its stdout carries frames only: anything the packages print goes
to stderr.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what Model-Optimizer or transformers print must not corrupt the frames
    protocol_in = sys.stdin.buffer

    import torch
    import transformers

    from held import process_wire as wire
    from held.modelopt_ops import ModelOptOperations, recipe
    from impl.interface import Unsupported

    operations, targets, drafters = ModelOptOperations(), {}, {}

    def special(kind, value):
        if kind == "target":
            if "config" in value:  # sent once, then by key
                config = transformers.AutoConfig.for_model(**value["config"])
                model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
                model.load_state_dict(value["state"], strict=True)
                targets[value["key"]] = model.to(value["dtype"]).eval()
            return targets[value["key"]]
        if kind == "drafter":
            return drafters[value["key"]]
        return None

    def answer(message):
        if message["op"] == "recipe":
            return recipe()
        if message["op"] == "drafter_to":
            drafters[message["key"]] = drafters[message["key"]].to(message["dtype"])
            return None
        args = wire.decode(message["args"], special)
        kwargs = wire.decode(message["kwargs"], special)
        result = getattr(operations, message["op"])(*args, **kwargs)
        if message["op"] == "build_drafter":
            drafters[message["key"]] = result
            return None
        return wire.encode(result)

    torch.set_num_threads(1)
    while True:
        try:
            message = wire.read_frame(protocol_in)
        except EOFError:
            return 0
        for key in message.get("release", ()):
            drafters.pop(key, None)
        try:
            reply = {"ok": answer(message)}
        except Unsupported as error:
            reply = {"unsupported": str(error)}
        except Exception as error:  # noqa: BLE001 - the plug raises it on its side, as the codebase's own error
            reply = {"error": type(error).__name__, "message": str(error)}
        wire.write_frame(protocol_out, reply)


if __name__ == "__main__":
    sys.exit(main())
