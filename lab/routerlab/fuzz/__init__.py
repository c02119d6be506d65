"""`prefix-router fuzz`: hostile request bodies through normalise, key and pick; nothing may escape.

``decide()`` promises never to raise for any body or headers, and the pick path builds on
whatever it returns. This command holds both to that. ``documents`` builds well-formed
requests, ``shapes`` turns them (and raw bytes) into hostile ones, ``checks`` says what any
decision and pick must satisfy, and ``runner`` runs, times and reports them (the command).
"""

from routerlab.fuzz.runner import add_arguments, run

__all__ = ["add_arguments", "run"]
