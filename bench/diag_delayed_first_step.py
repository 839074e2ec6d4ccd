"""Does DelayedScaling's first step hold back the demo GPT? (issue 5's loss criterion)

With an empty amax history every delayed scale is 1 at the first step: the gradients of the demo
GPT (~1e-5 and below) then mostly underflow E5M2, and the first AdamW update and its second
moments see a wrong gradient (``diag_gpt_grads.md``: norm-wise errors of 1.0-1.8 for every block
parameter under delayed scaling, 0.05-0.1 under current scaling). This runs
``examples/train_gpt.py --recipe delayed`` with its first training step under
Float8CurrentScaling instead, which records the same amaxes into the same buffers, so from the
second step on the delayed scales come from measured amaxes (one recompile when the recipe
changes)::

    python -m bench.diag_delayed_first_step [train_gpt.py flags]
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

import te_compile
from tests.utils import load_script

TRAIN_GPT = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tg = load_script("train_gpt", TRAIN_GPT)
    models = []
    init = tg.GPT.__init__

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if isinstance(self.recipe, te_compile.recipe.DelayedScaling):
            self._delayed_recipe = self.recipe
            self.recipe = te_compile.recipe.Float8CurrentScaling(fp8_format=self.recipe.fp8_format)
            models.append(self)

    def swap(optimizer, args, kwargs):
        while models:
            model = models.pop()
            model.recipe = model._delayed_recipe
            print("diag_delayed_first_step: first step under current scaling, delayed from now on")

    tg.GPT.__init__ = patched_init
    register_optimizer_step_post_hook(swap)
    return tg.main(["--recipe", "delayed", *argv])


if __name__ == "__main__":
    sys.exit(main())
