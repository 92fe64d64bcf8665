"""The test models' sizes, which every exact count is built from, are what testing/models.py says they are."""

from deepspeed_zero3.testing.models import MODEL_A_NUMEL, MODEL_B_NUMEL, count_params, model_a, model_b


def module_numels(model):
    return [sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()
            if any(True for _ in module.parameters(recurse=False))]


def test_model_a_and_b_sizes():
    a, b = model_a(), model_b()
    assert count_params(a) == MODEL_A_NUMEL and count_params(b) == MODEL_B_NUMEL
    assert module_numels(a) == [4_352] + [263_168, 262_400] * 12 + [1_028]
    assert module_numels(b) == [1_088] + [16_640, 16_448] * 6 + [260]
