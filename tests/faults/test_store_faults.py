"""The gateway's disk fills up, then fails read-only, under a running gateway process: buyers get
a prompt error answer (no hang, no charge), the log names the cause and the fix, and the gateway
serves again once the disk has room (without a restart) or once the disk is repaired and the
gateway restarted in the same home.

The disk is real: the gateway's data directory is an ext4 filesystem on a loop device
(`LoopFilesystem`), filled with a ballast file until the kernel says ENOSPC, then failed through
ext4's own error path, after which the kernel remounts it read-only under the open store, as it
does for a failing disk. Mounting needs root, as CI has; elsewhere the module is skipped with the
reason.
"""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from engy_node.testing.faults import FaultUnavailable, LoopFilesystem, ProcessAccount, account_row, check_books
from tests.faults.conftest import BuyerCall, new_buyer, plain_script, start_synthetic_miner, words
from tests.faults.nodes import GatewayProcess

ANSWER = words(8)
DISK_MIB = 48
"""Room for the store and the logs of a short run, small enough to fill in a moment."""


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("store-faults")


@pytest.fixture(scope="module")
def disk(home):
    filesystem = LoopFilesystem(home.parent / f"{home.name}.img", home / "data", size_mib=DISK_MIB)
    try:
        filesystem.__enter__()
    except FaultUnavailable as unavailable:
        # CI runs as root with loop devices: there, a disk that cannot be faulted is a broken
        # suite, not a reason to check nothing.
        if os.environ.get("CI"):
            pytest.fail(f"cannot inject disk faults in CI: {unavailable}")
        pytest.skip(f"cannot inject disk faults here (run as root with loop devices to check them): {unavailable}")
    yield filesystem
    filesystem.__exit__(None, None, None)


@pytest.fixture(scope="module")
def account(home):
    return ProcessAccount(home)


@pytest.fixture(scope="module")
def gateway(home, disk, account, checkpoint):
    # The model's checkpoint (270 MB, which the gateway would otherwise copy here across
    # filesystems) stays on the machine's own disk; the store and the logs are on the small one.
    models = home / "data" / "models"
    models.mkdir()
    (models / checkpoint.name).symlink_to(checkpoint)
    gateway = GatewayProcess(home, account)
    gateway.start()
    yield gateway
    gateway.stop()
    account.note_marked()
    assert account.alive() == [], "every process of the gateway's home has exited"
    assert account.listening() == [], "no port the gateway used still listens"


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=60) as client:
        yield client


async def ask(gateway: GatewayProcess, key: str, content: str, *, stream: bool = True) -> BuyerCall:
    call = BuyerCall(api=gateway.buyer_url + "/v1", key=key, content=content, stream=stream)
    await call.run()
    return call


async def test_a_full_disk_fails_requests_cleanly_without_charging_and_serving_resumes_when_it_has_room(
    nursery, gateway, disk, http, served, figures
):
    await start_synthetic_miner(
        nursery,
        store_path=gateway.store_path,
        miner_url=gateway.miner_url,
        served=served,
        http=http,
        script=lambda frame: plain_script(ANSWER),
    )
    account_id, key = new_buyer(gateway.store_path)
    warm = await ask(gateway, key, "before the disk fills")
    assert warm.error is None, warm.error
    before = account_row(gateway.store_path, account_id)

    ballast = disk.fill()
    failed = [await ask(gateway, key, f"while the disk is full {index}", stream=index % 2 == 0) for index in range(4)]
    for call in failed:
        assert isinstance(call.error, openai.APIStatusError), f"a prompt error answer, not {call.error!r}"
        assert call.error.status_code in (500, 503), call.error
    assert account_row(gateway.store_path, account_id) == before, "nothing is held or charged while the disk is full"
    await gateway.wait_for_from_trio(
        r"disk holding .* is full; free space and retry", timeout_s=10, what="the log naming the full disk and the fix"
    )

    disk.drain()
    again = await ask(gateway, key, "after the disk has room again")
    assert again.error is None and again.text == ANSWER, f"served again once the disk has room: {again.error!r}"
    books = check_books(gateway.store_path)
    after = account_row(gateway.store_path, account_id)
    assert after.charged > before.charged and after.held == 0
    figures.record("disk full: the buyer's answer", f"{failed[0].error.status_code} {failed[0].error.message!r}")
    figures.record(
        "disk full under a running gateway",
        len(failed),
        f" requests refused cleanly (no charge, {ballast // (1024 * 1024)} MiB ballast), served again without a restart; "
        f"books: {books.holds} holds, none open",
    )


async def test_a_buyer_refused_for_a_full_disk_gets_an_error_body_in_the_apis_format(
    nursery, gateway, disk, http, served
):
    await start_synthetic_miner(
        nursery,
        store_path=gateway.store_path,
        miner_url=gateway.miner_url,
        served=served,
        http=http,
        script=lambda frame: plain_script(ANSWER),
    )
    _, key = new_buyer(gateway.store_path)
    disk.fill()
    try:
        response = await http.post(
            gateway.buyer_url + "/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": "smollm2-135m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        )
    finally:
        disk.drain()
    assert response.status_code >= 500
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else None
    assert body is not None and body["error"]["message"], f"a JSON error a buyer can read, not {response.text!r}"


async def test_a_disk_failing_read_only_fails_requests_cleanly_and_a_restart_after_repair_serves_with_intact_books(
    nursery, gateway, disk, http, served, figures
):
    await start_synthetic_miner(
        nursery,
        store_path=gateway.store_path,
        miner_url=gateway.miner_url,
        served=served,
        http=http,
        script=lambda frame: plain_script(ANSWER),
    )
    account_id, key = new_buyer(gateway.store_path)
    warm = await ask(gateway, key, "before the disk fails")
    assert warm.error is None, warm.error
    before = account_row(gateway.store_path, account_id)

    disk.fail_read_only()
    assert disk.read_only(), "the kernel turned the disk read-only"
    failed = [
        await ask(gateway, key, f"while the disk is read-only {index}", stream=index % 2 == 0) for index in range(4)
    ]
    for call in failed:
        assert isinstance(call.error, openai.APIStatusError), f"a prompt error answer, not {call.error!r}"
    await gateway.wait_for_from_trio(
        r"cannot read or write .*gateway\.sqlite3 .*the disk failed or turned read-only; .*dmesg",
        timeout_s=10,
        what="the log naming the failed disk and the fix",
    )

    assert gateway.stop() is not None
    disk.repair()
    await gateway.start_from_trio()
    books = check_books(gateway.store_path)
    assert account_row(gateway.store_path, account_id) == before, "nothing was held or charged on the read-only disk"
    again = await ask(gateway, key, "after the repair")
    assert again.error is None and again.text == ANSWER, f"served after the repair: {again.error!r}"
    check_books(gateway.store_path)
    figures.record("disk read-only: the buyer's answer", f"{failed[0].error.status_code} {failed[0].error.message!r}")
    figures.record(
        "disk failed read-only under a running gateway",
        len(failed),
        f" requests refused cleanly (no charge); after e2fsck and a restart, books intact ({books.holds} holds, none open)",
    )
