"""runs.tasks.crash_reason: a run that crashed on a full disk says so first, whatever exception surfaced."""
import errno

from runs.tasks import DISK_FULL_BELOW, crash_reason


class Usage:
    def __init__(self, free):
        self.total, self.used, self.free = 10 << 30, 0, free


def test_a_crash_with_room_on_disk_is_reported_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr("runs.tasks.shutil.disk_usage", lambda path: Usage(1 << 30))
    assert crash_reason(RuntimeError("engine gone"), tmp_path) == "RuntimeError: engine gone"


def test_an_enospc_anywhere_in_the_chain_leads_the_message(tmp_path, monkeypatch):
    monkeypatch.setattr("runs.tasks.shutil.disk_usage", lambda path: Usage(1 << 30))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "ckpt/model.safetensors")
        except OSError:
            raise RuntimeError("engine at x unreachable for POST /resume")  # a later error masks it
    except RuntimeError as exc:
        reason = crash_reason(exc, tmp_path)
    assert reason == (f"No space left on device: the disk of {tmp_path} is full (1024.0 MiB free); free some space, "
                      "then resume the run (it goes on from its last checkpoint). "
                      "RuntimeError: engine at x unreachable for POST /resume")


def test_a_crash_on_a_full_disk_says_so_even_without_an_enospc(tmp_path, monkeypatch):
    monkeypatch.setattr("runs.tasks.shutil.disk_usage", lambda path: Usage(DISK_FULL_BELOW - (1 << 20)))
    reason = crash_reason(ConnectionResetError(104, "Connection reset by peer"), tmp_path)
    assert reason.startswith(f"No space left on device: the disk of {tmp_path} is full (15.0 MiB free);")
    assert reason.endswith("ConnectionResetError: [Errno 104] Connection reset by peer")


def test_a_missing_runs_folder_is_no_disk_full(tmp_path):
    assert crash_reason(ValueError("bad"), tmp_path / "gone") == "ValueError: bad"
