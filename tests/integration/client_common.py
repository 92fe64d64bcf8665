"""The RL and PEFT client flows' model pieces, data and losses, shared by client_flows.py (inside each
launched rank) and the plain-PyTorch reference (reference.py, in the pytest process).

Nothing here imports DeepSpeed, Accelerate or TRL; transformers and peft only inside functions.
"""

import torch

from common import SEED, make_llama, token_sample

PROMPT_LEN = 4
NEW_TOKENS = 6
GROUP = 2       # completions sampled per prompt (GRPO's group)
PROMPTS = 2     # prompts per rank and step: a training batch of PROMPTS * GROUP sequences
LORA_TARGETS = ["q_proj", "v_proj"]
# Only matters if a frozen base module ran in training mode: the reference keeps them all in eval mode.
BASE_ATTENTION_DROPOUT = 0.5


def prompts(rank: int, step: int) -> torch.Tensor:
    """A rank's prompts at a step, the same in every process (ids 2.. so no prompt holds bos/eos)."""
    generator = torch.Generator().manual_seed(2_000_000 + 1_000 * step + rank)
    return torch.randint(2, 128, (PROMPTS, PROMPT_LEN), generator=generator)


def sampling_seed(rank: int, step: int) -> int:
    return 3_000_000 + 1_000 * step + rank


def generate(model, prompt_ids: torch.Tensor, sample: bool, seed: int = 0) -> torch.Tensor:
    """``model.generate`` with exactly NEW_TOKENS new tokens (min = max, so every rank runs as many
    forwards and no sequence ends early); sampling draws from torch's global generator, seeded here."""
    kwargs = dict(do_sample=True, num_return_sequences=GROUP, top_k=0, top_p=1.0, temperature=1.0) if sample else \
        dict(do_sample=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(input_ids=prompt_ids, attention_mask=torch.ones_like(prompt_ids),
                              max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0, **kwargs)


def advantages(sequences: torch.Tensor) -> torch.Tensor:
    """GRPO's group-normalized advantage of a toy reward: the share of even completion tokens."""
    reward = (sequences[:, PROMPT_LEN:] % 2 == 0).float().mean(-1).view(-1, GROUP)
    centered = reward - reward.mean(-1, keepdim=True)
    return (centered / (reward.std(-1, keepdim=True) + 1e-4)).view(-1)


def grpo_loss(model, sequences: torch.Tensor, advantage: torch.Tensor):
    """GRPO's on-policy loss (one update per generation: the ratio is 1, no clipping applies, no KL term);
    returns the loss and the mean completion-token log-probability."""
    logits = model(input_ids=sequences).logits[:, PROMPT_LEN - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, sequences[:, PROMPT_LEN:, None]).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    return -(ratio * advantage[:, None]).mean(), logp.detach().mean()


def train_batch(rank: int, step: int) -> torch.Tensor:
    """A rank's 4 training sequences at a step (the supervised flows)."""
    return torch.stack([token_sample("train", 4 * (2 * step + rank) + i) for i in range(4)])


# ---------------------------------------------------------------- peft


def make_lora_llama(eval_base: bool):
    """The tiny Llama with LoRA adapters on q_proj and v_proj; the adapters' initial weights seeded right
    before they are made. With ``eval_base`` the base has attention dropout, which only a base module
    (wrongly) left in training mode would apply; without, every module trains, and nothing is random."""
    from peft import LoraConfig, get_peft_model

    base = make_llama(attention_dropout=BASE_ATTENTION_DROPOUT if eval_base else 0.0)
    torch.manual_seed(SEED + 1)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return get_peft_model(base, config)


def is_lora_module(name: str) -> bool:
    return "lora_" in name


def set_lora_modes(model, eval_base: bool) -> None:
    """With ``eval_base``, every LoRA module (lora_A, lora_B, lora_dropout and their entries) in training mode
    and every other one in eval mode; without, all in training mode."""
    for name, module in model.named_modules():
        module.train(is_lora_module(name) or not eval_base)


def modules_in_training_mode(model):
    return [name for name, module in model.named_modules() if module.training]


def make_merge_llama():
    """LoRA on q_proj, v_proj and the token embedding (a lora.Embedding), lm_head in modules_to_save, and a second
    adapter with a LoRA bias on q_proj (the attention has biases here), both active: every merge path."""
    from peft import LoraConfig, get_peft_model

    base = make_llama(attention_bias=True)
    torch.manual_seed(7)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, modules_to_save=["lm_head"],
                                            target_modules=["q_proj", "v_proj", "embed_tokens"]))
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"],
                                           lora_bias=True))
    model.base_model.set_adapter(["default", "second"])
    return model
