"""Shared test settings, applied before JAX starts.

* Four virtual CPU devices, so that data-parallel code (pmap, meshes, shard_map collectives)
  is tested on every run; single-device code still runs on device 0.
* float32 matmuls at full precision, so that tolerances mean what they say.
* XLA's CPU backend compiles with LLVM at -O0 (``TEST_XLA_FLAGS``, also passed to the
  subprocesses tests start). Most of the suite's time is compilation of small programs, not
  running them: tests/models took 288 s at the default level and 195 s at -O0 (2 workers, cold
  cache). LLVM's level changes how the kernels are vectorised and scheduled; the arithmetic is
  the same up to contracted multiply-adds (XLA does not enable fast-math on CPU), far inside
  every tolerance here. Tests also use XLA:CPU's older (LLVM IR) fusion emitters instead of its
  MLIR ones (``--xla_cpu_use_fusion_emitters=false``), which at -O0 compile the suite's programs
  faster: a one-block ViT-B train step with scan, remat and bfloat16 in 1.9-2.2 s instead of
  4.5-6.0; tests/models 208 -> 147 s, tests/train with the token-budget sweep 331 -> 261 s
  (2 workers, cold cache). Their elementwise kernels (exp, tanh, erf) are XLA's own float32
  approximations either way. At the default level they are the slower choice (a ViT-Ti/16 train
  step compiled in 24 s instead of 8 and ran in 4.6 s instead of 4.2), so users keep the MLIR
  emitters. Benchmarks and experiments run with XLA's defaults; ``VITMM_TEST_XLA_OPT=1`` runs
  the tests with them too.
* Each xdist worker is pinned to one core of those it may use (``VITMM_TEST_PIN=0``: not pinned). XLA
  sizes its CPU thread pool from the process's affinity, so two unpinned workers each ran a pool as
  wide as the machine on the same cores; pinned, tests/models took 163 s instead of 193 s (2 workers,
  2 cores, cold cache, one run each). Subprocesses a test starts share their worker's core (the
  two-process tests give each process a core of its own: ``VITMM_TEST_CORES``).
* One persistent XLA compilation cache for the session, shared by both xdist workers and every
  subprocess a test starts (through the environment): many tests compile the very same smoke
  train step (the trainer's resume test alone compiles it three times: 78 s without the cache,
  53 s cold, 33 s warm). Programs are keyed by their HLO, options and the JAX version, so a hit
  is the same executable. ``VITMM_TEST_XLA_CACHE=`` (empty) turns it off.
* ``clip_smoke_run`` (and ``siglip_chunked_smoke_run``, ``clip_every_step_run``): one trained smoke run for the session,
  for the tests that need a trained CLIP (initialising from it, a VLM tower, the token-budget
  sweep) or a reference run to compare against (pmap vs jit, resuming) rather than a run of
  their own; training tests that vary the config keep ``total_steps`` at the smoke's 4 so that their
  train steps compile to the same program (the schedule's length is a constant in it).
"""

import dataclasses
import fcntl
import json
import os
import pathlib
import tempfile

import ml_collections
import pytest

TEST_XLA_FLAGS = ("" if os.environ.get("VITMM_TEST_XLA_OPT") == "1"
                  else "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ["VITMM_TEST_XLA_FLAGS"] = TEST_XLA_FLAGS  # for the subprocesses that set their own XLA_FLAGS
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS, "--xla_force_host_platform_device_count=4"]).strip()
from vitmm import xla_flags  # noqa: E402 - the suite runs with the settings vitmm's entry points use

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and os.environ.get("VITMM_TEST_PIN", "1") == "1":
    _cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VITMM_TEST_CORES", ",".join(map(str, _cores)))  # (for tests that spread processes)
    os.sched_setaffinity(0, {_cores[int(_worker[2:]) % len(_cores)]})

xla_flags.use_vitmm_defaults()

_cache = os.environ.get("VITMM_TEST_XLA_CACHE", os.path.join(tempfile.gettempdir(), f"vitmm-test-xla-{os.getuid()}"))
if _cache:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# The four devices are this process's (XLA reads XLA_FLAGS once, when the backend starts, here).
# The processes tests start (``vitmm.train`` runs, studies' workers) get one device unless a test
# asks for more (``VITMM_TEST_XLA_FLAGS_4_DEVICES``): a smoke run then takes ~5 s instead of ~7 (warm cache),
# and dozens are started.
jax.devices()
os.environ["VITMM_TEST_XLA_FLAGS_4_DEVICES"] = os.environ["XLA_FLAGS"]
os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace("--xla_force_host_platform_device_count=4",
                                                       "--xla_force_host_platform_device_count=1")


ROOT = pathlib.Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class SharedRun:
    workdir: pathlib.Path  # read-only for the tests: copy it before training on top of it
    data_dir: str
    summary: dict  # what trainer.train returned (through JSON)


def _shared_run(tmp_path_factory, name: str, arg: str, data_dir: str | None = None, evals: bool = True,
                **overrides) -> SharedRun:
    """``configs/{name}.py:{arg}`` (with ``overrides``; no evaluators unless ``evals``) trained once
    for the whole session. xdist workers share one run: the first to get the lock trains, the
    others read its summary."""
    from vitmm import config_args
    from vitmm.train import trainer

    base = tmp_path_factory.getbasetemp()
    key = "-".join([name, arg, *(f"{k}-{v}" for k, v in sorted(overrides.items()))] + ([] if evals else ["noevals"]))
    key = key.replace(",", "-").replace("=", "-")
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared_run-{key}"
    root.mkdir(exist_ok=True)
    workdir, done = root / "run", root / "summary.json"
    data_dir = data_dir or str(root / "tfds")
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            config = config_args.load(ROOT / "configs" / f"{name}.py", arg,
                                      **{"input.data_dir": data_dir, **overrides})
            if not evals:
                with config.unlocked():
                    config.evals = ml_collections.ConfigDict()
            summary = trainer.train(config, workdir)
            (root / "summary.tmp").write_text(json.dumps(summary, default=float))
            (root / "summary.tmp").rename(done)
    return SharedRun(workdir, data_dir, json.loads(done.read_text()))


@pytest.fixture(scope="session")
def clip_smoke_run(tmp_path_factory):
    """``configs/clip_scenes.py:smoke`` (4 steps, logged at 2 and 4, evaluated and checkpointed
    at 4): the trained CLIP of the session."""
    return _shared_run(tmp_path_factory, "clip_scenes", "smoke")


@pytest.fixture(scope="session")
def clip_every_step_run(tmp_path_factory, clip_smoke_run):
    """The CLIP smoke logged and checkpointed at every step, no evaluators, on the smoke run's
    data: the uninterrupted reference the reliability tests damage, interrupt and resume copies of."""
    return _shared_run(tmp_path_factory, "clip_scenes", "smoke", data_dir=clip_smoke_run.data_dir, evals=False,
                       log_every=1, checkpoint_every=1)


@pytest.fixture(scope="session")
def siglip_chunked_smoke_run(tmp_path_factory):
    """``configs/siglip_scenes.py:smoke,loss=sigmoid_chunked``, trained once for the session."""
    return _shared_run(tmp_path_factory, "siglip_scenes", "smoke,loss=sigmoid_chunked")


# The longest tests (each 15-55 s on 2 cores, `--durations`), dealt out to start first on every
# worker: xdist's load scheduling hands each of N workers a chunk of len/N/4 tests in collection
# order to begin with, so these go to the head of each first chunk in turn; otherwise one worker can
# take them all, or finish alone with a minute's test at the end.
SLOWEST_FIRST = (
    "tests/train/test_multihost.py::test_two_processes_train_as_one_and_stop_together_on_sigterm",
    "tests/test_lmms_eval.py::test_the_budget_study_scores_runs_with_lmms_eval_as_the_qa_evaluator_does",
    "tests/train/test_reliability.py::test_a_sigkill_at_a_random_step_ends_where_an_uninterrupted_run_ends",
    "tests/train/test_raw_data_runs.py::test_clip_trains_on_tar_shards_in_worker_processes_resumes_and_evaluates_on_a_csv",
    "tests/models/test_native_vlm.py::test_anyres_vlm_hands_the_lm_exactly_the_counted_tokens",
    "tests/train/test_tensor_parallel.py::test_a_tensor_parallel_run_on_8_devices_resumes_on_4_without_it",
    "tests/train/test_raw_data_runs.py::test_llava_stages_train_resume_exactly_count_bad_examples_and_chat",
    "tests/train/test_vlm_training.py::test_the_smollm2_config_runs_both_stages_on_converted_fixtures",
    "tests/train/test_reliability.py::test_a_signal_saves_the_current_step_and_the_resumed_run_matches",
    "tests/experiments/reliability/test_resume_check.py::test_resume_check_compares_a_resumed_run_step_by_step",
    "tests/train/test_reliability.py::test_a_resume_with_a_changed_config_says_what_changed_and_refuses_what_matters",
    "tests/train/test_trainer.py::test_packed_native_resolution_run_trains_evaluates_and_resumes_exactly",
)


def pytest_collection_modifyitems(config, items):
    workers = config.getoption("numprocesses", None) if config.pluginmanager.hasplugin("xdist") else None
    workers = workers if isinstance(workers, int) and workers > 1 else 1
    slow = {nodeid: i for i, nodeid in enumerate(SLOWEST_FIRST)}
    first = sorted((item for item in items if item.nodeid in slow), key=lambda item: slow[item.nodeid])
    rest = [item for item in items if item.nodeid not in slow]
    chunk = max(len(items) // workers // 4, 2)  # xdist's first chunk per worker (LoadScheduling)
    heads = [first[w::workers] for w in range(workers)]
    ordered = []
    for w in range(workers):
        ordered += heads[w]
        take = max(chunk - len(heads[w]), 0) if w < workers - 1 else len(rest)
        ordered, rest = ordered + rest[:take], rest[take:]
    items[:] = ordered + rest
