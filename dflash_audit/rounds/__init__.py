"""One core for rounds: every source of speculative-decoding rounds held to the audit's replay of z-lab's loop.

A *source of rounds* (`source.RoundSource`) is whatever ran the drafter: a serving engine (vLLM:
`vllm.py`, llama.cpp: `llamacpp.py`, each run by `dflash_audit/audit/live_check.py` and `live_llamacpp.py`) or a
team's own evaluator recorded by `trace --eval`. It gives, per prompt (`source.PromptRounds`):

- `rounds`: the tokens each round added, the bonus included (z-lab's `acceptance_lengths`), or, built with
  `PromptRounds.from_accepted`, from the accepted count per round (each round adds those and the target's token);
- `blocks`: the proposals each round drafted (its verification judged them), where the source knows them;
- `output`: the tokens it generated, where known (to check greedy output, and for the target's replay);
- `feed`: where the source knows it, what the drafter was fed at round r (`source.DrafterFeed`: the block, its
  positions, the context rows and their target features, any module outputs it captured).

The source also says how to explain a parting round (`source.Localizer`): by value on what the drafter was fed
(`by_value.FedLocalizer`, given `cite(kind)` -> the source's file:line for each input or module), by counterfactual
replays (the llama.cpp source: an engine with no hook), by an evaluator's own round-by-round checks (`trace --eval`:
`dflash_audit/trace/evaluation/why.py`'s `EvaluatorLocalizer`), and the near-tie rule (`ties.flip_near_ties`) for
float sums breaking an argmax near-tie the other way.

The one assessment (`assess.assess`) takes the source and the audit's replay (`replay.zlab_replay`: z-lab's loop with
the drafter as the audit has it, the same prompts, the same stop ids) and gives per prompt τ on both sides, the rounds
compared (`match.match_rounds`) and the first that parts, acceptance per draft position, and the localizer's findings
as `Finding` records, merged one per root cause.

A source plugs in so:

    source = RoundSource("eval.py", spec.block_size - 1,
                         [PromptRounds.from_accepted(p["id"], p["ids"], accepted[i], output[i], blocks[i])
                          for i, p in enumerate(prompts)],
                         localize=FedLocalizer(drafter, target, cite))
    assessment = assess(source, zlab_replay(drafter, target, source.prompts, max_new_tokens, stop_ids))
"""

from dflash_audit.rounds.assess import Assessment, assess, merge
from dflash_audit.rounds.replay import zlab_replay
from dflash_audit.rounds.source import DrafterFeed, Localized, Localizer, PromptRounds, RoundSource

__all__ = ["Assessment", "DrafterFeed", "Localized", "Localizer", "PromptRounds", "RoundSource", "assess", "merge",
           "zlab_replay"]
