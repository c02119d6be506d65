"""What the launcher reads from the OS about a vLLM server: is its port free, its memory, its log.

Kept apart from :mod:`~routerlab.realvllm.fleet` because none of it is about vLLM: stdlib only,
so the launcher still runs in the vLLM venv.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

_ERROR_LINE = re.compile(r"\b\w*(Error|Exception): ")


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def rss_mb_tree(pid: int) -> float:
    """Resident memory (MB) of ``pid`` and its descendants, from /proc (0 if unknown)."""
    try:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    st = f.read()
                ppid = int(st.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                continue
        total = 0.0
        todo = [pid]
        seen = set()
        while todo:
            p = todo.pop()
            if p in seen:
                continue
            seen.add(p)
            try:
                with open(f"/proc/{p}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) / 1024.0
                            break
            except OSError:
                pass
            todo.extend(children.get(p, []))
        return total
    except OSError:
        return 0.0



def last_line(log: Path) -> str:
    """The last line of ``log`` (at most 160 characters; empty if unreadable)."""
    try:
        lines = log.read_text(errors="replace").strip().splitlines()
        return lines[-1][-160:] if lines else ""
    except OSError:
        return ""


def log_tail(log: Path, n: int = 30) -> str:
    """The last ``n`` lines of ``log``, plus its first error line (root cause)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    first_err = next((ln for ln in lines if _ERROR_LINE.search(ln) and "WARNING" not in ln), "")
    head = f"first error line: {first_err}\n" if first_err else ""
    return head + f"--- last {n} lines of {log} ---\n" + "\n".join(lines[-n:])
