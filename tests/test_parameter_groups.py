"""Per-component learning rates (issue 26): the ``parameter_groups`` hook names shares of the trainable parameters
by name prefix; each becomes a torch parameter group at its own peak learning rate, which the LR schedule scales like
``[optimizer] lr``; parameters in no group, and groups without an lr, train at ``[optimizer] lr``."""

from __future__ import annotations

import pytest
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from diffpipe_core.config import OptimizerConfig
from diffpipe_core.optim import build_optimizer, lr_lambda, parameter_groups
from diffpipe_core.registry import Registry
from diffpipe_core.types import ParameterGroup


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit_kahan", "sgd"])
def test_named_groups_train_at_their_learning_rates(optimizer: str) -> None:
    model = nn.ModuleDict({"text_encoder": nn.Linear(2, 2), "text_encoder_2": nn.Linear(2, 2), "down": nn.Linear(2, 2)})
    named = dict(model.named_parameters())
    assert parameter_groups(named, None) == list(named.values())
    groups = [
        ParameterGroup("text_encoder_1", ("text_encoder.",), 1e-3),
        ParameterGroup("text_encoder_2", ("text_encoder_2.",)),
        ParameterGroup("nothing", ("up.",), 9.0),
    ]
    opt = build_optimizer(OptimizerConfig(type=optimizer, lr=2e-4), parameter_groups(named, groups), Registry().pm)
    names = {id(p): n for n, p in named.items()}
    got = [(g["name"], g["lr"], [names[id(p)] for p in g["params"]]) for g in opt.param_groups]
    assert got == [
        ("text_encoder_1", 1e-3, ["text_encoder.weight", "text_encoder.bias"]),
        ("text_encoder_2", 2e-4, ["text_encoder_2.weight", "text_encoder_2.bias"]),
        ("default", 2e-4, ["down.weight", "down.bias"]),  # the empty group is left out
    ]
    scheduler = LambdaLR(opt, lr_lambda("linear", 0, 4))
    scheduler.step()
    assert scheduler.get_last_lr() == pytest.approx([0.75e-3, 1.5e-4, 1.5e-4])
