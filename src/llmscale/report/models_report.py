"""What `llmscale models` prints: the model presets, their shapes and parameter counts."""

from __future__ import annotations

from rich.table import Table

from llmscale.model.config import PRESETS, ModelConfig

COLUMNS = ("name", "layers", "dim", "heads", "kv", "ffn", "vocab", "params", "published")


def model_row(m: ModelConfig) -> list[str]:
    """One preset's cells, in `COLUMNS` order (the published count, or "-" where none is)."""
    published = f"{m.published_params:,}" if m.published_params else "-"
    shape = (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size)
    return [m.name, *map(str, shape), f"{m.num_params():,}", published]


def models_table(presets: dict[str, ModelConfig] = PRESETS) -> Table:
    """The presets as a table, one row each, counts right-aligned."""
    t = Table(title="llmscale model presets")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "name" else "right")
    for m in presets.values():
        t.add_row(*model_row(m))
    return t
