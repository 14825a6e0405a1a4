"""The fault suite's own instruments, shown to catch what they are for: books that do not balance,
a hold left open or closed twice, a request charged twice or logged at another cost, and a
process or a port a test left behind. A check that cannot fail would make every fault test pass."""

from __future__ import annotations

import socket
import subprocess
import sys

from engy_node.gateway.store import RequestLogEntry, Store
from engy_node.testing.faults import AccountRow, LedgerRow, ProcessAccount, RequestRow, books_problems, read_books
from tests.waiting import wait_until


def test_books_written_through_the_store_are_sound_and_an_open_hold_is_reported(tmp_path):
    path = tmp_path / "gateway.sqlite3"
    with Store.open(path) as store:
        account, _ = store.create_buyer("buyer")
        store.credit(account, micro_usd=1_000)
        settled = store.hold(account, amount=300, request_id="settled")
        store.settle(settled, cost=120)
        store.hold(account, amount=200, request_id="in-flight")
        store.log_request(
            RequestLogEntry(
                request_id="settled",
                account_id=account,
                miner="key:1",
                model="smollm2-135m",
                api="openai",
                kind="paid",
                status=200,
                prompt_tokens=10,
                completion_tokens=5,
                cached_tokens=0,
                cost_micro=120,
                ttft_ms=1.0,
                tpot_ms=1.0,
                created_at=1.0,
            )
        )
    books = read_books(path)
    assert books.problems == ()
    assert books.open_holds == ("in-flight",) and (books.charges, books.charged_micro) == (1, 120)
    assert books.unlogged_charges == ()
    books.assert_sound(open_holds_allowed=True)
    try:
        books.assert_sound()
    except AssertionError as error:
        assert "1 hold(s) still open: in-flight" in str(error)
    else:
        raise AssertionError("an open hold must fail the books once recovery ran")


ACCOUNT = AccountRow(account_id=1, available=700, held=0, credited=1_000, charged=300)
CREDIT = LedgerRow(1, 1, "credit", 1_000, None, None)
HOLD = LedgerRow(2, 1, "hold", 500, "r1", None)
SETTLE = LedgerRow(3, 1, "settle", 300, "r1", 2)
RELEASE = LedgerRow(4, 1, "release", 200, "r1", 2)


def test_balanced_books_have_no_problem():
    assert books_problems([ACCOUNT], [CREDIT, HOLD, SETTLE, RELEASE], [RequestRow("r1", 1, "paid", 200, 300)]) == []


def test_a_cached_balance_that_the_rows_do_not_explain_is_a_problem():
    drifted = AccountRow(account_id=1, available=800, held=0, credited=1_000, charged=300)
    assert any("available" in problem for problem in books_problems([drifted], [CREDIT, HOLD, SETTLE, RELEASE], []))


def test_a_second_closure_of_a_hold_and_a_second_charge_are_problems():
    again = [LedgerRow(5, 1, "settle", 300, "r1", 2), LedgerRow(6, 1, "release", 0, "r1", 2)]
    charged_twice = AccountRow(account_id=1, available=400, held=0, credited=1_000, charged=600)
    problems = books_problems([charged_twice], [CREDIT, HOLD, SETTLE, RELEASE, *again], [])
    assert any("closed by" in problem for problem in problems)
    assert any("charged 2 times" in problem for problem in problems)


def test_a_closure_that_does_not_add_up_to_its_hold_is_a_problem():
    short = LedgerRow(4, 1, "release", 150, "r1", 2)
    account = AccountRow(account_id=1, available=650, held=50, credited=1_000, charged=300)
    assert any(
        "of 500 is closed by 450" in problem for problem in books_problems([account], [CREDIT, HOLD, SETTLE, short], [])
    )


def test_a_request_logged_at_another_cost_than_it_was_charged_or_logged_twice_is_a_problem():
    ledger = [CREDIT, HOLD, SETTLE, RELEASE]
    assert any(
        "logged as costing 250" in problem
        for problem in books_problems([ACCOUNT], ledger, [RequestRow("r1", 1, "paid", 200, 250)])
    )
    twice = [RequestRow("r1", 1, "paid", 200, 300), RequestRow("r1", 1, "paid", 200, 300)]
    assert any("logged as charged 2 times" in problem for problem in books_problems([ACCOUNT], ledger, twice))
    refunded = [CREDIT, HOLD, LedgerRow(3, 1, "settle", 0, "r1", 2), LedgerRow(4, 1, "release", 500, "r1", 2)]
    unpaid = AccountRow(account_id=1, available=1_000, held=0, credited=1_000, charged=0)
    assert any(
        "the ledger charged 0" in problem
        for problem in books_problems([unpaid], refunded, [RequestRow("r1", 1, "paid", 200, 300)])
    )


def test_a_process_and_a_port_left_behind_are_found_and_gone_once_stopped(tmp_path):
    marker = str(tmp_path / "home")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = (
        "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); "
        "print('listening', flush=True); time.sleep(600)"
    )
    child = subprocess.Popen([sys.executable, "-c", script, str(port), marker], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "listening"
        account = ProcessAccount(marker)
        account.note(child.pid)
        assert [line for line in account.alive() if f"pid {child.pid}:" in line]
        assert account.listening() == [port]
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
    wait_until(lambda: account.listening() == [], timeout_s=10, what="the killed child's port closed")
    assert account.alive() == []
