"""scripts/gpu_suite.sh's helpers, which run only on the device: how the GPU test files are dealt
to its shards (gpu_shards.py), and that the summary names a shard its time limit cut
(gpu_suite_summary.py): such a shard leaves its log and no JUnit file; and that the compile
before them (gpu_warm_kernels.py) takes every module the engine has."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# counts as gpu_suite.sh writes them (`pytest --collect-only -m gpu`, node ids cut at their
# parameters, `uniq -c`): a few functions of the files of 2026-12-06
COLLECTED = """     62 tests/gpu/test_kernels_gpu.py::test_every_type_matches_the_reference
     60 tests/gpu/test_device_prompt.py::test_grouped_kernels_every_type_on_ragged_tiles
     48 tests/gpu/test_kernels_gpu.py::test_batched_kernels_every_type
     24 tests/gpu/test_kernels_gpu.py::test_deq_h_splits_each_weight_into_two_f16
     30 tests/gpu/test_device_step.py::test_the_device_step_gives_the_cpu_logits
      6 tests/gpu/test_kernels_gpu.py::test_gemm_products_are_the_int8_product_within_float32_rounding
      3 tests/gpu/test_kernels_gpu.py::test_mmt_keeps_mm_bits_on_long_rows_and_many_tiles
      9 tests/gpu/test_device_spec.py::test_the_verify_rows_have_the_bits_of_the_device_token_step
      1 tests/engine/test_serve.py::test_on_the_gpu_tier_the_replies_are_the_cpus_and_metrics_count_hits
"""


def test_a_large_files_functions_go_to_several_shards_and_every_test_runs_once():
    m = _load("gpu_shards")
    counts = m.read_counts(COLLECTED)
    files = sorted({k.split("::")[0] for k in counts}) + ["tests/gpu/test_new.py"]  # one the collection did not list (an error in it)
    dealt = m.deal(counts, files, 4)
    units = [u for shard in dealt for u in shard]
    assert sorted(units) == sorted(list(counts) + ["tests/gpu/test_new.py"])  # each function once, the unlisted file whole
    kernels = [k for k, shard in enumerate(dealt) if any(u.startswith("tests/gpu/test_kernels_gpu.py::") for u in shard)]
    assert len(kernels) >= 3  # the kernel tests (~500 s in one process on an H100) spread out
    loads = [sum(m.weight(counts, u) for u in shard) for shard in dealt]
    assert max(loads) - min(loads) <= max(m.weight(counts, u) for u in units)  # the largest first, each to the least loaded
    # more shards than tests: the extra ones are empty, none is dealt twice
    assert [len(s) for s in m.deal({"a::x": 3, "b": 2}, ["a", "b"], 4)] == [1, 1, 0, 0]


def test_the_shard_lists_are_written_for_the_suite(tmp_path):
    m = _load("gpu_shards")
    (tmp_path / "gpu_collected.txt").write_text(COLLECTED)
    assert m.main(["2", str(tmp_path), "tests/gpu/test_kernels_gpu.py", "tests/gpu/test_device_spec.py"]) == 0
    # the mmt test weighs its measured seconds (60 s: 171 tests' worth), not its 3 tests: a shard of
    # its own; then 62, 48, 24, 9 and 6 to the other
    mmt = "tests/gpu/test_kernels_gpu.py::test_mmt_keeps_mm_bits_on_long_rows_and_many_tiles"
    assert m.weight(m.read_counts(COLLECTED), mmt) == round(m.SECONDS[mmt] / m.PER_TEST) > 3
    assert (tmp_path / "gpu_shard_0.txt").read_text() == mmt
    assert (tmp_path / "gpu_shard_1.txt").read_text() == "tests/gpu/test_kernels_gpu.py::test_every_type_matches_the_reference " \
        "tests/gpu/test_kernels_gpu.py::test_batched_kernels_every_type " \
        "tests/gpu/test_kernels_gpu.py::test_deq_h_splits_each_weight_into_two_f16 " \
        "tests/gpu/test_device_spec.py::test_the_verify_rows_have_the_bits_of_the_device_token_step " \
        "tests/gpu/test_kernels_gpu.py::test_gemm_products_are_the_int8_product_within_float32_rounding"
    assert m.main(["0", str(tmp_path), "x"]) == 2


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0"
 skipped="0" tests="2"><testcase classname="t" name="a"/><testcase classname="t" name="b"/></testsuite></testsuites>"""


def test_the_summary_names_the_slowest_test_functions():
    m = _load("gpu_suite_summary")
    import xml.etree.ElementTree as ET

    root = ET.fromstring('<testsuite><testcase classname="tests.gpu.test_a" name="test_x[1]" time="2.5"/>'
                         '<testcase classname="tests.gpu.test_a" name="test_x[2]" time="3.0"/>'
                         '<testcase classname="tests.gpu.test_b" name="test_y" time="4.0"/></testsuite>')
    assert m.slowest(list(root.iter("testcase"))) == [(5.5, "tests/gpu/test_a.py::test_x"), (4.0, "tests/gpu/test_b.py::test_y")]


def test_the_summary_names_a_shard_cut_by_its_time_limit(tmp_path):
    m = _load("gpu_suite_summary")
    (tmp_path / "gpu_tests_0.xml").write_text(JUNIT)
    (tmp_path / "gpu_tests_0.log").write_text("2 passed\n")
    rows, ok = m.test_rows(tmp_path, 0)
    assert ok and rows[0] == ("GPU tests", "2 passed, 0 failed, 0 errors, 0 skipped (pytest exit 0)")
    (tmp_path / "gpu_tests_1.log").write_text("......")  # cut: no gpu_tests_1.xml
    (tmp_path / "gpu_shard_1.txt").write_text("tests/gpu/test_kernels_gpu.py")
    rows, ok = m.test_rows(tmp_path, 124)
    assert not ok
    assert ("  NO RESULT", "shard 1 left no result file (cut at its time limit?): tests/gpu/test_kernels_gpu.py") in rows


def test_the_warm_up_compiles_every_module_the_engine_has_once():
    # gpu_warm_kernels.py fills CuPy's disk cache before the shards: a module it leaves out is
    # compiled again inside a shard (the kernel tests' shard was cut by that, 2026-12-06)
    from strata.index_format.ggml_types import TYPES

    from strata.engine.kernels import gpu

    keys = _load("gpu_warm_kernels").module_keys()
    assert sorted(keys) == sorted([t.name for t in TYPES] + ["device step", "actq"] + [t.name + gpu.ROWS for t in TYPES if t.quantized])
    quantized = {t.name for t in TYPES if t.quantized}
    assert set(keys[:len(quantized)]) == quantized  # the slowest start first


def test_the_warm_up_without_a_gpu_says_why_and_fails(capsys, monkeypatch):
    from strata.engine.kernels import gpu

    monkeypatch.setattr(gpu, "available", lambda: (False, "CuPy is not importable (the test)"))
    assert _load("gpu_warm_kernels").main([]) == 1
    assert "no GPU (CuPy is not importable (the test))" in capsys.readouterr().err
