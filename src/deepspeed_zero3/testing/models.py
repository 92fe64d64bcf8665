"""Small deterministic models used by tests, the parity suite, the demo and the benchmark.

Model A and Model B are the models of the upstream measurements in
docs/benchmarks.md; their sizes are part of the expected numbers in the tests,
defined here once:

* Model A, 6,312,196 parameters: inp Linear(16, 256) 4,352; 12 blocks of up
  Linear(256, 1024) 263,168 and down Linear(1024, 256) 262,400; head Linear(256, 4) 1,028.
* Model B, 199,876 parameters: inp Linear(16, 64) 1,088; 6 blocks of up Linear(64, 256)
  16,640 and down Linear(256, 64) 16,448; head Linear(64, 4) 260.
"""

import torch
from torch import nn


class ResidualMLPBlock(nn.Module):

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class ResidualMLP(nn.Module):
    """``Linear(inp, width)``, ``blocks`` residual blocks of ``Linear(width, hidden)`` + ``Linear(hidden, width)``, ``Linear(width, out)``.

    With ``training_branch=True`` an auxiliary Linear runs only in training mode: a model whose
    module order differs between train and eval.
    """

    def __init__(self, inp=16, width=256, hidden=1024, blocks=12, out=4, training_branch=False):
        super().__init__()
        self.inp = nn.Linear(inp, width)
        self.blocks = nn.ModuleList(ResidualMLPBlock(width, hidden) for _ in range(blocks))
        self.head = nn.Linear(width, out)
        self.aux = nn.Linear(width, width) if training_branch else None

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        if self.aux is not None and self.training:
            h = h + self.aux(h)
        return self.head(h)


MODEL_A_NUMEL = 6_312_196
MODEL_B_NUMEL = 199_876


def model_a(**kwargs) -> ResidualMLP:
    """Model A, the benchmark's larger model: a residual MLP of 12 blocks, 6,312,196 parameters."""
    return ResidualMLP(inp=16, width=256, hidden=1024, blocks=12, out=4, **kwargs)


def model_b(**kwargs) -> ResidualMLP:
    """Model B, the benchmark's default: a residual MLP of 6 blocks, 199,876 parameters."""
    return ResidualMLP(inp=16, width=64, hidden=256, blocks=6, out=4, **kwargs)


def tiny_mlp(**kwargs) -> ResidualMLP:
    return ResidualMLP(inp=8, width=16, hidden=32, blocks=3, out=2, **kwargs)


class CausalSelfAttention(nn.Module):

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        shape = (batch, seq, self.heads, dim // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class GPTBlock(nn.Module):

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style language model: token + position embeddings, pre-LN blocks, LM head."""

    def __init__(self, vocab=128, dim=64, heads=4, layers=4, max_seq=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, targets=None):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class Wrapper(nn.Module):
    """What Lightning does: a fresh wrapper module around the user's model for every engine."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.module = inner

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class LeafBranches(nn.Module):
    """Upstream's ``TestZeroUserBackwardLeafModule`` model, wider: made a z3 leaf, ``branches`` (a ModuleList)
    never runs a forward of its own ([Note: a parameter read while in flight])."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.branches = nn.ModuleList([nn.Linear(dim, dim), nn.Linear(dim, dim)])
        self.final = nn.Linear(dim, dim)

    def forward(self, x):
        return self.final(self.branches[0](x) + self.branches[1](x))


class ReadsAhead(nn.Module):
    """The root reads ``c.weight`` before ``c`` runs ([Note: a parameter read while in flight])."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.a = nn.Linear(dim, dim)
        self.c = nn.Linear(dim, dim)

    def forward(self, x):
        return self.c(self.a(x) @ self.c.weight.t())


def llama_from_config(attn_implementation=None, **config):
    """A ``LlamaForCausalLM`` built from ``LlamaConfig(**config)`` (never downloaded); ``attn_implementation``
    (``"eager"``, say) set on the config when given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(**config)
    if attn_implementation is not None:
        llama_config._attn_implementation = attn_implementation
    return LlamaForCausalLM(llama_config)


def count_params(model: nn.Module) -> int:
    """Parameter count, also for a model already partitioned by ZeRO-3 (``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
