from llmscale.model.config import PRESETS, get_preset
from llmscale.report.models_report import COLUMNS, model_row, models_table


def test_every_preset_has_a_row_with_its_counts() -> None:
    t = models_table()
    assert t.row_count == len(PRESETS)
    assert [c.header for c in t.columns] == list(COLUMNS)
    names = list(t.columns[0].cells)
    assert names == list(PRESETS)


def test_row_cells_follow_the_config() -> None:
    m = get_preset("llama2-7b")
    row = dict(zip(COLUMNS, model_row(m), strict=True))
    assert row["layers"] == str(m.n_layers) and row["kv"] == str(m.n_kv_heads)
    assert row["params"] == f"{m.num_params():,}"
    assert row["published"] == (f"{m.published_params:,}" if m.published_params else "-")
