"""The soak (`python -m deepspeed_zero3.bench.soak`, `make soak`) at 20 steps, so the command cannot rot.

Every event kind runs (eval forwards in both modes, generation, a third engine twice) on 2 ranks. The
structural criteria (live numel 0 at step ends, constant ZeRO hooks) are enforced at any length; the
slope and trace-record ones need a steady state, so the run is --relaxed and they are not asserted.
"""

import json
import subprocess
import sys

TIMEOUT_S = 300
STEPS = 20


def test_soak_smoke(tmp_path):
    cmd = [sys.executable, "-m", "deepspeed_zero3.bench.soak", "--steps", str(STEPS), "--eval-every", "2",
           "--generate-every", "5", "--generate-tokens", "3", "--engine-every", "10", "--relaxed",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    result = json.loads((tmp_path / "soak.json").read_text())
    assert result["passed"] and result["meta"]["world"] == 2 and result["meta"]["wall_seconds"] > 0
    assert len(result["ranks"]) == 2
    for rank, summary in zip(result["per_rank"], result["ranks"]):
        assert len(rank["series"]["rss_kib"]) == STEPS and all(v > 0 for v in rank["series"]["rss_kib"])
        assert summary["live_numel_max"] == 0
        assert summary["zero_hooks_min"] == summary["zero_hooks_max"] > 0 and summary["zero_hooks_after_close"] == 0
        assert summary["owners_min"] == summary["owners_max"] == 2  # the third engine's destroy dropped its ownership
        events = {name for step in rank["events"] for name in step}
        assert events == {"train", "eval", "eval_train_mode", "generate", "third_engine"}
    assert "| RSS slope over the second half, KiB/step |" in proc.stdout and "soak passed" in proc.stdout
    png = (tmp_path / "soak.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
