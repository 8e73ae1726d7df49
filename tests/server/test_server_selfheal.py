"""Self-healing against the session server (``specdec-serve``: tritonserver
plus its engine watchdog), whose engine processes are killed with SIGKILL as
an out-of-memory kill or a segfault would end them.

* the draft's stub killed under load: the requests in flight complete,
  identical to plain decoding, the server stays ready, and speculation
  (drafted tokens > 0) is back within 60 s;
* the target's stub killed under load: readiness turns non-200 within 10 s,
  the requests in flight end with an error naming the target (no hang), and
  the server serves again within 120 s;
* no other process of the server's tree is touched; after three
  crash/recover cycles the server's processes together hold no more memory
  than before, tritonserver no more than what Triton keeps of a dead
  instance, and the killed stubs' regions are gone from /dev/shm.

Marked ``kills_engines``: they run after every other test (tests/conftest.py),
so no other test shares the server with a dead engine."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tritonclient.utils import InferenceServerException

from selfheal import stubs
from tests.conftest import ServerAddress
from tests.server_client import complete, concurrently, http_status
from tools.soak import process_memory, process_tree

pytestmark = [pytest.mark.slow, pytest.mark.kills_engines]

PROMPTS = ("def fibonacci(n):\n    ", "def is_prime(n: int) -> bool:\n    ")
TOKENS = 24  # per request: several seconds of rounds, so both are in flight at the kill 2 s in
DRAFT_BACK_SECONDS = 60
TARGET_UNREADY_SECONDS = 10
TARGET_BACK_SECONDS = 120
# The draft model on a fixed window: drafts every round whatever the policy learned from earlier tests.
DRAFTING = dict(drafter="draft_model", speculation_window=4, adaptive_window=False)
PER_CRASH_KIB = 8 * 1024  # measured: about 1 MiB of tritonserver's RSS per crash
PER_CRASH_SHM = 2 * 2**20  # measured: the dead stub's 1 MiB region (shm-default-byte-size)


@dataclass
class HealingServer:
    address: ServerAddress
    launcher_pid: int
    server_pid: int
    watchdog_url: str
    log_path: Path
    memory: list = field(default_factory=list)  # _memory() before the first kill and after each recovery
    regions: set = field(default_factory=set)  # names of the stubs' shared-memory regions seen
    killed_regions: list = field(default_factory=list)  # the killed stubs' regions


def _wait(condition, timeout: float, what: str, log_path: Path, step: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"{what} not within {timeout:g} s; log tail:\n{log_path.read_text(errors='replace')[-4000:]}")


def _ready(address: ServerAddress) -> bool:
    try:
        return http_status(address, "/v2/health/ready")[0] == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def healing(triton_server) -> HealingServer:
    if not triton_server.launcher_pid:
        pytest.skip("kills engine processes: needs a server the tests started")
    healing = HealingServer(triton_server, triton_server.launcher_pid, triton_server.pid,
                            triton_server.watchdog_url, triton_server.log_path)
    _wait(lambda: _watchdog_metric(healing.watchdog_url, "specdec_engine_up", "draft") == 1, 60, "watchdog",
          healing.log_path)
    return healing


def _watchdog_metric(url: str, name: str, model: str) -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
    except OSError:
        return None
    prefix = f'{name}{{model="{model}"}} '
    return next((float(line[len(prefix):]) for line in body.splitlines() if line.startswith(prefix)), None)


def _tree(healing: HealingServer) -> dict[int, str]:
    """pid -> name of every process under specdec-serve (stubs named after their instance)."""
    names = {}
    for pid in process_tree(healing.launcher_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        instance = next((a.decode() for a in argv if stubs.instance_model(a.decode(errors="replace"))), None)
        names[pid] = instance or Path(argv[0].decode(errors="replace")).name
    return names


def _stub(healing: HealingServer, model: str) -> int:
    (pid,) = stubs.stub_pids(model, healing.server_pid)
    return pid


def _memory(healing: HealingServer) -> tuple[int, int, int]:
    """(tritonserver's RSS in KiB, bytes in /dev/shm of every shared-memory
    region a stub of this server has had, the killed ones' included, and the
    RSS in KiB of every process under specdec-serve together)."""
    tree = _tree(healing)
    for pid, name in tree.items():
        if stubs.instance_model(name) and (region := stubs.shm_region(pid)):
            healing.regions.add(region)
    paths = [stubs.SHM_DIR / region for region in healing.regions]
    everything = sum((process_memory(pid) or ("", 0))[1] for pid in tree)
    return process_memory(healing.server_pid)[1], sum(p.stat().st_size for p in paths if p.exists()), everything


def _under_load(healing: HealingServer, victim: str, **request) -> tuple[list, float]:
    """Two streamed requests; ``victim``'s stub killed once both are decoding.
    Returns each request's Completion or exception, and the kill's time."""
    outcomes: list = [None] * len(PROMPTS)
    started = threading.Barrier(len(PROMPTS) + 1)

    def run(i):
        started.wait()
        try:
            outcomes[i] = complete(healing.address, PROMPTS[i], max_tokens=TOKENS, timeout=180, **request)
        except Exception as error:  # noqa: BLE001 - the test judges it
            outcomes[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(2.0)  # both past their first tokens (prefill of a short prompt: well under a second)
    victim_pid = _stub(healing, victim)
    region = stubs.shm_region(victim_pid)
    assert region, f"no shared-memory region on the command line of {victim}'s stub {victim_pid}"
    healing.killed_regions.append(region)
    killed = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=200)
    assert not any(thread.is_alive() for thread in threads), "a request hung after the kill"
    return outcomes, killed


def test_a_killed_draft_costs_no_request_and_speculation_comes_back(healing):
    plain = [c.text for c in concurrently(healing.address, [(p, dict(max_tokens=TOKENS, speculation_window=0))
                                                             for p in PROMPTS])]
    before = complete(healing.address, PROMPTS[0], max_tokens=TOKENS, **DRAFTING)
    assert before.draft_tokens > 0
    tree = _tree(healing)
    memory_before = _memory(healing)
    unready = []
    watching = threading.Event()

    def watch_readiness():  # the draft is reloaded in place: the server stays ready throughout
        while not watching.is_set():
            if not _ready(healing.address):
                unready.append(time.monotonic())
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_readiness)
    watcher.start()
    outcomes, killed = _under_load(healing, "draft", **DRAFTING)
    for outcome, expected in zip(outcomes, plain):
        assert not isinstance(outcome, Exception), outcome
        assert outcome.completion_tokens == TOKENS and outcome.text == expected

    meanwhile = complete(healing.address, PROMPTS[1], max_tokens=TOKENS, **DRAFTING)
    assert meanwhile.text == plain[1]  # a request while the draft is reloaded completes on the target

    def drafting():
        # Ask the watchdog first: back-to-back requests would keep the target
        # decoding and slow the draft's reload on a 2-core machine.
        if _watchdog_metric(healing.watchdog_url, "specdec_engine_up", "draft") != 1:
            return None
        sent = time.monotonic()
        result = complete(healing.address, PROMPTS[1], max_tokens=TOKENS, **DRAFTING)
        assert result.text == plain[1]
        return sent if result.draft_tokens > 0 else None

    try:
        sent = _wait(drafting, DRAFT_BACK_SECONDS - (time.monotonic() - killed), "speculation back", healing.log_path)
    finally:
        watching.set()
        watcher.join()
    back = sent - killed  # a request sent then drafted: speculation was back by then
    print(f"\ndraft killed: speculation back after {back:.1f} s (the request that drafted again was sent then)")
    assert back <= DRAFT_BACK_SECONDS
    assert not unready, "the server turned not ready while its draft was reloaded"
    assert _watchdog_metric(healing.watchdog_url, "specdec_engine_recoveries_total", "draft") == 1
    _unharmed(healing, tree, replaced="draft")
    healing.memory += [memory_before, _memory(healing)]


def test_a_killed_target_turns_the_server_unready_then_it_serves_again(healing):
    _wait(lambda: _ready(healing.address), 60, "ready before the kill", healing.log_path)
    tree = _tree(healing)
    expected = complete(healing.address, PROMPTS[0], max_tokens=TOKENS, speculation_window=0).text
    unready_at: list[float] = []
    watching = threading.Event()

    def watch_readiness():
        while not watching.is_set():
            if not _ready(healing.address):
                unready_at.append(time.monotonic())
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_readiness)
    watcher.start()
    outcomes, killed = _under_load(healing, "target")
    watcher.join(timeout=TARGET_UNREADY_SECONDS + 5)
    watching.set()
    assert unready_at, "readiness never turned non-200"
    print(f"\ntarget killed: unready after {unready_at[0] - killed:.1f} s")
    assert unready_at[0] - killed <= TARGET_UNREADY_SECONDS
    for outcome in outcomes:
        assert isinstance(outcome, InferenceServerException), outcome
        assert "target" in outcome.message(), outcome.message()

    _wait(lambda: _ready(healing.address), TARGET_BACK_SECONDS - (time.monotonic() - killed), "ready again",
          healing.log_path)
    again = complete(healing.address, PROMPTS[0], max_tokens=TOKENS, **DRAFTING)
    print(f"target killed: serving again after {time.monotonic() - killed:.1f} s")
    assert time.monotonic() - killed <= TARGET_BACK_SECONDS
    assert again.text == expected and again.draft_tokens > 0
    assert _watchdog_metric(healing.watchdog_url, "specdec_engine_recoveries_total", "target") == 1
    _unharmed(healing, tree, replaced="target")
    healing.memory.append(_memory(healing))


def test_three_crash_cycles_leave_memory_where_it_was(healing):
    """Third cycle (a draft kill again), then the server's memory against its
    value before the first kill. The dead engines' weights die with their
    processes; what Triton 2.51 keeps of a dead instance (its calls in flight
    are never released, so about 1 MiB of its bookkeeping stays) must stay
    that small, and the watchdog removes the dead stubs' regions."""
    outcomes, _ = _under_load(healing, "draft", **DRAFTING)
    assert all(not isinstance(o, Exception) for o in outcomes), outcomes
    _wait(lambda: _watchdog_metric(healing.watchdog_url, "specdec_engine_recoveries_total", "draft") == 2,
          DRAFT_BACK_SECONDS, "third recovery", healing.log_path)
    complete(healing.address, PROMPTS[0], max_tokens=TOKENS, **DRAFTING)
    healing.memory.append(_memory(healing))
    (rss0, shm0, all0), (rss1, shm1, all1), (rss2, shm2, all2), (rss3, shm3, all3) = healing.memory
    print(f"\ntritonserver RSS MiB: {rss0 / 1024:.0f} before, then {rss1 / 1024:.0f}, {rss2 / 1024:.0f}, "
          f"{rss3 / 1024:.0f} after each crash; stubs' /dev/shm MiB: {shm0 / 2**20:.0f}, {shm1 / 2**20:.0f}, "
          f"{shm2 / 2**20:.0f}, {shm3 / 2**20:.0f}; the whole server's RSS MiB: {all0 / 1024:.0f}, "
          f"{all1 / 1024:.0f}, {all2 / 1024:.0f}, {all3 / 1024:.0f}")
    # The dead engines' weights and caches went with their processes; the new ones hold what the old did.
    assert all3 <= 1.05 * all0, "the server's processes hold more memory than before the crashes"
    assert rss3 - rss0 <= 3 * PER_CRASH_KIB, "tritonserver grew by more than a dead instance's bookkeeping"
    assert shm3 - shm0 <= 3 * PER_CRASH_SHM, "more than a dead stub's region left in /dev/shm"
    left = [region for region in healing.killed_regions if (stubs.SHM_DIR / region).exists()]
    assert not left, f"the watchdog left killed stubs' regions in /dev/shm: {left}"


def _unharmed(healing: HealingServer, before: dict[int, str], replaced: str):
    """Every process of the tree but the killed engine's stub is still there,
    and that engine has a stub again."""
    after = _tree(healing)
    lost = {pid: name for pid, name in before.items() if pid not in after and not name.startswith(f"{replaced}_")}
    assert not lost, f"processes gone besides {replaced}'s stub: {lost}"
    assert any(name.startswith(f"{replaced}_") for name in after.values())
    assert stubs.alive(healing.launcher_pid)
