"""The cross-rank order check's bookkeeping and messages, without a process group."""

import pytest
from torch import nn

from deepspeed_zero3.runtime.zero.rank_agreement import (CHECK_RANKS_ENV, MAX_PENDING_PASSES, PassOrderCheck,
                                                         check_ranks_from_env)
from deepspeed_zero3.runtime.zero.passes import PassKind


class Other(nn.Identity):
    pass


def numbered(*ids, kind=nn.Identity):
    modules = []
    for ds_id in ids:
        module = kind()
        module.ds_id = ds_id
        modules.append(module)
    return modules


def add(check, number, kind, modules):
    check.add(number, kind, [m.ds_id for m in modules], modules)


@pytest.mark.parametrize("kind", [PassKind.FORWARD, PassKind.EVAL_FORWARD])
def test_due_after_backward_and_after_a_batch_of_passes_without_one(kind):
    """Eval forwards and generated tokens are compared in batches of MAX_PENDING_PASSES (or at the next
    backward), not one check (a collective and a host sync) each."""
    check = PassOrderCheck()
    assert check.due(PassKind.BACKWARD) and not check.due(PassKind.EVAL_FORWARD)
    for number in range(MAX_PENDING_PASSES - 1):
        add(check, number, kind, numbered(0, 1))
        assert not check.due(kind)
    add(check, MAX_PENDING_PASSES, kind, numbered(0, 1))
    assert check.due(kind)
    check.check()  # no process group: nothing to compare, and the pending orders are dropped
    assert check.pending == []


def test_message_names_each_ranks_pass_step_and_module():
    check = PassOrderCheck()
    add(check, 3, PassKind.EVAL_FORWARD, numbered(7, kind=Other))  # this rank ran ds_id 7 too, earlier
    add(check, 4, PassKind.FORWARD, numbered(0, 1, 2))
    add(check, 5, PassKind.BACKWARD, numbered(2, 1, 0))
    mine = check.flat()
    other = list(mine)
    other[-2] = 7  # the backward's step 1 ran another module
    message = check.describe(check.pending, [mine, other])
    assert message.startswith("deepspeed-zero3: ranks ran different modules (checked after pass 5, covering "
                              "passes 3..5): rank 0: backward pass, step 1, module Identity ds_id=1; rank 1: "
                              "backward pass, step 1, module Other ds_id=7.")


def test_message_when_one_rank_ran_fewer_modules():
    check = PassOrderCheck()
    add(check, 0, PassKind.EVAL_FORWARD, numbered(0, 1, 2))
    mine = check.flat()
    message = check.describe(check.pending, [mine, mine[:-1]])
    assert "rank 0: eval_forward pass, step 2, module Identity ds_id=2; rank 1: eval_forward pass, ended before " \
           "step 2" in message


@pytest.mark.parametrize("raw, expected", [("1", True), ("0", False), ("", False), ("on", True)])
def test_check_ranks_env(raw, expected):
    assert check_ranks_from_env({CHECK_RANKS_ENV: raw}) is expected


@pytest.mark.parametrize("raw, expected", [("1", True), ("", True), ("0", False), ("off", False), ("Yes", True)])
def test_pass_agreement_env(raw, expected):
    from deepspeed_zero3.runtime.zero.pass_agreement import PASS_AGREEMENT_ENV, pass_agreement_from_env

    assert pass_agreement_from_env({PASS_AGREEMENT_ENV: raw}) is expected
    assert pass_agreement_from_env({}) is True  # on by default


def test_pass_agreement_env_names_a_bad_value():
    from deepspeed_zero3.runtime.zero.pass_agreement import pass_agreement_from_env

    with pytest.raises(ValueError, match=r"DEEPSPEED_ZERO3_PASS_AGREEMENT='2' is not allowed: use 1 \(default\)"):
        pass_agreement_from_env({"DEEPSPEED_ZERO3_PASS_AGREEMENT": "2"})


def test_pass_agreement_names_every_ranks_pass():
    from deepspeed_zero3.runtime.zero.pass_agreement import PassAgreement
    from deepspeed_zero3.runtime.zero.passes import PassKind
    from deepspeed_zero3.runtime.zero.rank_agreement import AGREEMENT_TAG

    kinds = list(PassKind)
    seen = [[AGREEMENT_TAG, kinds.index(PassKind.FORWARD), 8], [AGREEMENT_TAG, kinds.index(PassKind.EVAL_FORWARD), 8],
            [3, 40, 12345]]
    message = PassAgreement().describe(PassKind.FORWARD, 8, seen, rank=0)
    assert ("rank 0: forward pass, gathering pass 8; rank 1: eval_forward pass, gathering pass 8; rank 2: ending a "
            "pass (comparing module orders)") in message
    assert "synced_gpus=True" in message and "abandon_step" in message
