"""services/resident.py's parsing and combining, without a process: /proc/PID/status lines,
the engine's /metrics, and which figure a reading takes and says it took."""

from macserve.services.resident import combine, parse_metrics, parse_status

STATUS = """Name:\tpython3
VmPeak:\t  900000 kB
VmHWM:\t   250000 kB
VmRSS:\t   120000 kB
Threads:\t4
"""


def test_status_gives_rss_and_the_high_water_mark_in_bytes():
    assert parse_status(STATUS) == (120000 * 1024, 250000 * 1024)
    # a kernel thread or a zombie has no Vm lines: unknown, not zero
    assert parse_status("Name:\tkworker\nState:\tI (idle)\n") == (None, None)


METRICS = """# HELP macserve_memory_active_bytes MLX active memory
# TYPE macserve_memory_active_bytes gauge
macserve_memory_active_bytes 1.2345e+07
# TYPE macserve_memory_peak_bytes gauge
macserve_memory_peak_bytes{kind="mlx"} 40000000.0
macserve_memory_peak_bytes_extra 7
macserve_prompt_tokens_total 12.0
"""


def test_metrics_gives_the_engines_own_figures_or_none():
    assert parse_metrics(METRICS) == (12345000, 40000000)
    # llama-server's metrics: none of ours
    assert parse_metrics("llamacpp:prompt_tokens_total 5\n") == (None, None)


def test_the_larger_figure_is_taken_and_named():
    # Linux: the tree's RSS/VmHWM above MLX's own (the runtime beside the arrays)
    r = combine(7, (300, 500, 2), (100, 400), peak_known=True)
    assert (r.now_bytes, r.peak_bytes) == (300, 500)
    assert "2 processes" in r.source and "VmHWM" in r.source and "/metrics" in r.source
    # a Mac: RSS need not show Metal's buffers, MLX's figure is the larger; no VmHWM
    r = combine(7, (300, None, 1), (800, 900), peak_known=False)
    assert (r.now_bytes, r.peak_bytes, r.hwm_bytes) == (800, 900, None)
    assert r.note == ""
    # a Mac and a server with no figures of its own: the peak is unknown, and said so
    r = combine(7, (300, None, 1), (None, None), peak_known=False)
    assert (r.now_bytes, r.peak_bytes) == (300, None)
    assert "no per-process peak" in r.note and "/metrics" not in r.source
