"""merge_adapters=True on a model that is not a peft LoRA model names the model, whether or not peft is installed.

A user without peft gets the same ValueError as one with it (not a ModuleNotFoundError from inside the merge):
the model check comes before anything of peft is imported.
"""

import sys

import pytest
from torch import nn

from deepspeed_zero3.peft_merge import merged_units

NOT_LORA = r"expects a peft LoRA model \(PeftModel or LoraModel\), or the engine over one; got Sequential"


def test_a_plain_model_is_refused_by_name():
    with pytest.raises(ValueError, match=NOT_LORA):
        merged_units(nn.Sequential(nn.Linear(2, 2)))


def test_without_peft_installed_the_error_is_the_same(monkeypatch):
    for name in [m for m in sys.modules if m == "peft" or m.startswith("peft.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft now raises ImportError, as when it is absent
    with pytest.raises(ValueError, match=NOT_LORA):
        merged_units(nn.Sequential(nn.Linear(2, 2)))
