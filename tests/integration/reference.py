"""Plain-PyTorch references: one process, no DeepSpeed, no Lightning, no Trainer.

What "the same" means for ZeRO-3 on 2 ranks: both ranks start from the same weights (same seed);
at each training step rank r computes the mean loss of its own batch, and DeepSpeed averages the
two ranks' gradients (reduce-scatter) before the partitioned optimizer step. The reference does
that in one process: it computes both ranks' losses with the full model, backpropagates their mean,
and takes one step of the same torch optimizer (same hyper-parameters, same gradient clipping) on
the full parameters. Each rank's loss at each step is compared with the reference's loss for that
rank's batch; validation/evaluation batches are plain forwards without grad.

Not bitwise: DeepSpeed sums the two ranks' gradients in a different order (and in flat,
partitioned buffers) than autograd does for the mean loss, so gradients differ in the last bits;
Adam carries that into the weights. The tests use a relative tolerance of 1e-5 (observed: a few
1e-7), far below any real divergence (a skipped or doubled step, a stale gather, wrong data or a
wrong mode changes losses by 1e-2 or more).
"""

import torch

from common import WORLD, make_net, net_loss, sample, token_sample


def replay_lightning(events_by_rank, frozen_mid=False):
    """The losses each rank should have seen, for the sequence of events the flow reported.

    ``events_by_rank[r]`` is rank r's list of events (same kinds, in the same order, on every rank).
    Returns ``[losses of rank 0, losses of rank 1]`` in event order (optimizer events skipped) and the
    final parameters.
    """
    kinds = [[e["kind"] for e in events] for events in events_by_rank]
    assert all(k == kinds[0] for k in kinds), f"ranks report different event sequences: {kinds}"
    net = make_net(frozen_mid=frozen_mid)
    optimizer = None
    expected = [[] for _ in range(WORLD)]
    for position, kind in enumerate(kinds[0]):
        if kind == "optimizer":
            optimizer = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-3)
            continue
        batches = []
        for rank in range(WORLD):
            ids = events_by_rank[rank][position]["ids"]
            xs, ys = zip(*(sample("train" if kind == "train" else "val", rank, i) for i in ids))
            batches.append((torch.stack(xs), torch.stack(ys)))
        if kind == "val":
            with torch.no_grad():
                for rank, (x, y) in enumerate(batches):
                    expected[rank].append(net_loss(net(x), y).item())
            continue
        assert kind == "train", kind
        losses = [net_loss(net(x), y) for x, y in batches]
        optimizer.zero_grad()
        (sum(losses) / WORLD).backward()
        optimizer.step()
        for rank, loss in enumerate(losses):
            expected[rank].append(loss.item())
    return expected, {name: p.detach().clone() for name, p in net.named_parameters()}


def replay_hf(events_by_rank, lr=1e-3, max_grad_norm=1.0):
    """Same for the Hugging Face flows: events carry the token ids of each rank's batch.

    The Trainer's defaults are reproduced: AdamW (weight decay 0), a constant learning rate
    (the flows ask for ``lr_scheduler_type="constant"``) and gradient clipping at norm 1.0, which
    DeepSpeed applies to the averaged gradient ("gradient_clipping": "auto" -> max_grad_norm).
    """
    from common import make_llama

    kinds = [[e["kind"] for e in events] for events in events_by_rank]
    assert all(k == kinds[0] for k in kinds), f"ranks report different event sequences: {kinds}"
    model = make_llama()
    model.train()
    optimizer = None
    expected = [[] for _ in range(WORLD)]
    for position, kind in enumerate(kinds[0]):
        if kind == "optimizer":
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
            continue
        inputs = [torch.tensor(events_by_rank[rank][position]["input_ids"]) for rank in range(WORLD)]
        if kind == "eval":
            with torch.no_grad():
                for rank, ids in enumerate(inputs):
                    expected[rank].append(model(input_ids=ids, labels=ids).loss.item())
            continue
        assert kind == "train", kind
        losses = [model(input_ids=ids, labels=ids).loss for ids in inputs]
        optimizer.zero_grad()
        (sum(losses) / WORLD).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        for rank, loss in enumerate(losses):
            expected[rank].append(loss.item())
    return expected


# ---------------------------------------------------------------- the RL and PEFT client flows (client_flows.py)

GREEDY_MARGIN = 1e-4  # a recorded greedy token's logit may trail the reference's best by this much


def _same_kinds(events_by_rank):
    kinds = [[e["kind"] for e in events] for events in events_by_rank]
    assert all(k == kinds[0] for k in kinds), f"ranks report different event sequences: {kinds}"
    return kinds[0]


def _averaged_step(params, optimizer, losses, max_grad_norm=1.0):
    """One data-parallel step: the ranks' mean loss, clipped like DeepSpeed's gradient_clipping, AdamW."""
    optimizer.zero_grad()
    (sum(losses) / WORLD).backward()
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()


def _final(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def replay_grpo(events_by_rank, lr=1e-3):
    """The GRPO flows: each rank's mean completion log-probability per step, and the final parameters.

    The sequences each rank sampled are taken from its events (weights that differ in the last bits can
    sample other tokens); the first step's are sampled again here from the same seed and must be equal,
    since no update has happened yet. Advantages are recomputed and must equal the recorded ones exactly.
    """
    from client_common import advantages, generate, grpo_loss, sampling_seed
    from common import make_llama

    _same_kinds(events_by_rank)
    model = make_llama()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    expected = [[] for _ in range(WORLD)]
    for step in range(len(events_by_rank[0])):
        losses = []
        for rank in range(WORLD):
            event = events_by_rank[rank][step]
            sequences = torch.tensor(event["sequences"])
            if step == 0:
                again = generate(model, torch.tensor(event["prompts"]), sample=True, seed=sampling_seed(rank, step))
                assert torch.equal(again, sequences), f"rank {rank}: the first generation differs from the reference's"
            advantage = advantages(sequences)
            assert advantage.tolist() == event["advantages"], f"rank {rank} step {step}"
            loss, logp = grpo_loss(model, sequences, advantage)
            losses.append(loss)
            expected[rank].append(logp.item())
        _averaged_step(params, optimizer, losses)
    return expected, _final(model)


def replay_lora(events_by_rank, eval_base, lr=1e-3):
    """The peft flows: losses per rank (train and eval events), the modules in training mode, final parameters.
    Gradient checkpointing (lora_checkpointing) recomputes the same values: the reference runs without it."""
    from client_common import make_lora_llama, modules_in_training_mode, set_lora_modes

    kinds = _same_kinds(events_by_rank)
    model = make_lora_llama(eval_base)
    set_lora_modes(model, eval_base)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    expected = [[] for _ in range(WORLD)]
    for position, kind in enumerate(kinds):
        inputs = [torch.tensor(events_by_rank[rank][position]["input_ids"]) for rank in range(WORLD)]
        with torch.set_grad_enabled(kind == "train"):
            losses = [model(input_ids=ids, labels=ids).loss for ids in inputs]
        if kind == "train":
            _averaged_step(params, optimizer, losses)
        for rank, loss in enumerate(losses):
            expected[rank].append(loss.item())
    return expected, modules_in_training_mode(model), _final(model)


def replay_generate(events_by_rank, lr=1e-3):
    """The generate-between-steps flow: training losses per rank and final parameters; every greedy
    generation is checked here. Before the first update it must equal the reference's own generation;
    later, each generated token must be the reference's greedy choice up to GREEDY_MARGIN."""
    from client_common import PROMPT_LEN, generate
    from common import make_llama

    kinds = _same_kinds(events_by_rank)
    model = make_llama()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    expected = [[] for _ in range(WORLD)]
    updated = False
    for position, kind in enumerate(kinds):
        events = [events_by_rank[rank][position] for rank in range(WORLD)]
        if kind == "generate":
            for rank, event in enumerate(events):
                sequences = torch.tensor(event["sequences"])
                if not updated:
                    assert torch.equal(generate(model, torch.tensor(event["prompts"]), sample=False), sequences)
                with torch.no_grad():
                    logits = model(input_ids=sequences).logits[:, PROMPT_LEN - 1:-1]
                logits[..., model.config.eos_token_id] = -float("inf")  # min_new_tokens bars eos from the choice
                chosen = logits.gather(-1, sequences[:, PROMPT_LEN:, None]).squeeze(-1)
                shortfall = (logits.max(-1).values - chosen).max().item()
                assert shortfall <= GREEDY_MARGIN, f"rank {rank}, event {position}: not greedy by {shortfall}"
            continue
        assert kind == "train", kind
        inputs = [torch.tensor(e["input_ids"]) for e in events]
        losses = [model(input_ids=ids, labels=ids).loss for ids in inputs]
        _averaged_step(params, optimizer, losses)
        updated = True
        for rank, loss in enumerate(losses):
            expected[rank].append(loss.item())
    return expected, _final(model)


__all__ = ["replay_lightning", "replay_hf", "replay_grpo", "replay_lora", "replay_generate", "token_sample"]
