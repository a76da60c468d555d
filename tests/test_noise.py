"""The yardstick noise guard (metainfer/hardware/noise.py): rows judged by scripted readings,
so that each verdict is worked out by hand; and one real reading of this machine."""

import pytest

from metainfer.hardware import noise


class Scripted(noise.Yardstick):
    """A yardstick whose readings come from a list, in order: a number stands for a reading
    whose GEMM and copy both took that long (seconds); a pair gives each part."""

    def __init__(self, readings, **kw):
        super().__init__(warm=0, **kw)
        self._script = [r if isinstance(r, tuple) else (r, r) for r in readings]
        self._job = object()  # nothing to build

    def _read(self):
        return self._script.pop(0)


def test_a_row_between_readings_inside_the_band_counts_at_once():
    # run medians after the readings 1.00, 1.05: 1.025; both within 7%
    g = Scripted([1.00, 1.05])
    row = g.measure(lambda: "value", "steady")
    assert (row.value, row.stable, row.tries, row.yardstick_s) == ("value", True, 1, ((1.00, 1.00), (1.05, 1.05)))
    assert g.summary()["rows_remeasured"] == 0 and g.unstable == []


def test_a_row_during_a_swing_is_measured_again_and_kept_from_the_still_try():
    # readings: 1.0 x 3 set the medians; the first try's "after" reads 1.5 (50% off); the
    # second try reads 1.0 and 1.02: inside
    g = Scripted([1.0, 1.0, 1.0, 1.0, 1.5, 1.0, 1.02])
    for _ in range(3):
        g.readings.append(g._read())  # three warm readings
    values = iter(["during the swing", "after it"])
    row = g.measure(lambda: next(values), "swung")
    assert row.stable and row.tries == 2 and row.value == "after it"
    s = g.summary()
    assert s["rows"] == 1 and s["rows_remeasured"] == 1 and s["rows_unstable"] == 0
    assert s["copy"]["max_ms"] == pytest.approx(1500.0) and s["gemm"]["swing"] == pytest.approx(0.5)


def test_each_part_of_the_yardstick_is_judged_on_its_own():
    # the GEMM steady at 1.0; the copy 20% slow in the first try (memory contention alone)
    g = Scripted([(1.0, 2.0)] * 3 + [(1.0, 2.4), (1.0, 2.0), (1.01, 2.0), (1.0, 2.02)])
    for _ in range(3):
        g.readings.append(g._read())
    row = g.measure(lambda: "x", "memory-bound row")
    assert row.stable and row.tries == 2
    assert "copy 2000.00 / 2000.00 / 2400.00 ms (20%)" in g.line() and "gemm 1000.00" in g.line()


def test_a_row_that_never_holds_still_is_reported_unstable_with_its_closest_try():
    # medians 1.0 from 4 warm readings, then pairs (1.3, 1.0), (1.0, 1.1), (1.2, 1.2): off by
    # 30%, 10% and 20% (each against the medians at the time, which move with every reading)
    g = Scripted([1.0] * 4 + [1.3, 1.0, 1.0, 1.1, 1.2, 1.2], tries=3)
    for _ in range(4):
        g.readings.append(g._read())
    values = iter("abc")
    row = g.measure(lambda: next(values), "noisy row")
    assert not row.stable and row.tries == 3
    assert row.value == "b"  # the try whose readings sat closest to the medians
    assert g.unstable == ["noisy row"] and "noisy row" in g.line()


def test_the_band_is_checked():
    with pytest.raises(ValueError, match="band"):
        noise.Yardstick(band=0)
    with pytest.raises(ValueError, match="tries"):
        noise.Yardstick(tries=0)


def test_decisions_inside_the_measured_noise_have_no_verdict():
    # repeats 10.0 / 10.4 ms (4% apart) and 11.0 / 11.1; yardstick 1.00 .. 1.02: noise 4%
    band = noise.decision_noise([10.0, 10.4], [11.0, 11.1], [(1.0, 2.0), (1.02, 2.01), (1.01, 2.0)])
    assert band == pytest.approx(0.04)
    assert noise.verdict(10.2, 11.05, band) == "apply"  # 8.3% apart
    assert noise.verdict(10.2, 10.5, band) == "either"  # 2.9% apart
    assert noise.verdict(11.05, 10.2, band) == "decline"
    # a machine that drifted 20% across the runs: nothing under 20% is a verdict
    assert noise.verdict(10.2, 11.05, noise.decision_noise([10.2], [11.05], [(1.0, 2.0), (1.0, 2.4)])) == "either"


def test_a_real_reading_of_this_machine():
    g = noise.Yardstick(warm=2, repeat=2)
    r = g.read()
    # only that the job ran and was timed (its speed is whatever this machine gives now)
    assert len(r) == 2 and min(r) > 0 and len(g.readings) == 3
    assert g.measure(lambda: 7, "trivial").value == 7
