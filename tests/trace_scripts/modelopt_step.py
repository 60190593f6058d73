"""NVIDIA Model-Optimizer 0.47.0's own `hf_dflash` training step, unmodified, on a tiny target.

Run under its own environment (`.venv/modelopt-env/bin/python`: transformers 5.14.1, held/modelopt.py says why).
Set up as its `main.py` sets up a DFlash run: its shipped recipe (`modelopt_recipes/.../dflash.yaml`, the `dflash:`
section read by its `DFlashConfig`: block 8, 512 anchors, logit distillation, D-PACE) and
`modelopt.torch.speculative.convert`, which turns the target into its `HFDFlashModel` with the drafter
(`dflash_module`) inside it. The step is what its Hugging Face `Trainer` runs: the converted model's training
`forward(input_ids, attention_mask, labels)` (the target's forward, anchors, masks, drafter, `_compute_loss`), then
backward and an optimizer step. Settings for a CPU run, as the project's held/modelopt_ops.py makes them: the mask
token named (its auto-detection reads a tokenizer), the drafter's attention "eager", no torch.compile. No line of
the trace's: the step is the first backward, closed by the optimizer's step.
"""

import argparse

import modelopt
import torch
import yaml
from modelopt.torch import speculative as mtsp
from modelopt.torch.speculative.config import DFlashConfig
from pathlib import Path
from transformers import AutoModelForCausalLM


p = argparse.ArgumentParser()
p.add_argument("--target", required=True)
p.add_argument("--seq-len", type=int, default=48)
args = p.parse_args()
torch.manual_seed(0)
recipe_file = Path(modelopt.__file__).parents[1] / "modelopt_recipes" / "general" / "speculative_decoding" / "dflash.yaml"
recipe = yaml.safe_load(recipe_file.read_text())["dflash"]
model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
vocab = model.config.vocab_size
config = DFlashConfig(**{**recipe, "dflash_mask_token_id": vocab - 1, "dflash_use_torch_compile": False})
model = mtsp.convert(model, [("dflash", config.model_dump())])
model.dflash_config._attn_implementation = "eager"
model.train()
optim = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=6e-4)
for step in range(2):
    ids = torch.randint(1, vocab - 1, (1, args.seq_len))
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    optim.zero_grad()
    out.loss.backward()
    optim.step()
