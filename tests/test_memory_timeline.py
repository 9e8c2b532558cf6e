"""benchmarks/memory_timeline.py's split of the peak RSS by phase, by hand."""
from benchmarks.memory_timeline import peak_table


def parts(table: str) -> list:
    """The GiB column of the table's rows, in order."""
    return [float(line[44:51]) for line in table.splitlines()[1:]]


def test_the_peak_is_split_by_what_each_phase_added_to_the_highest_rss_so_far():
    # two graphs: (phase, seconds, RSS at its end, highest RSS during it, VmHWM), GiB
    rows = [("imports + context", 2.5, 0.40, 0.40, 0.40), ("model + optimizer build", 0.5, 0.50, 0.53, 0.53),
            ("compile ForwardBackward", 3.0, 0.60, 0.60, 0.60), ("run ForwardBackward (1st)", 2.0, 1.30, 1.40, 1.40),
            ("compile ApplyUpdate", 1.0, 1.30, 1.45, 1.45), ("run ApplyUpdate (1st)", 0.5, 1.50, 1.55, 1.55),
            ("5 more steps", 7.0, 1.50, 1.56, 1.56)]
    table = peak_table(rows, {"weights": 0.08, "the rest": 0.73})
    imports, build, compile_, run, peak = parts(table)
    assert (imports, build, peak) == (0.40, 0.13, 1.56)
    assert abs(compile_ - (0.07 + 0.05)) < 1e-9 and abs(run - (0.80 + 0.10 + 0.01)) < 1e-9  # both graphs
    assert abs(imports + build + compile_ + run - peak) < 1e-9
    assert "plan 0.08" in table.splitlines()[2] and "plan 0.73" in table.splitlines()[4]
