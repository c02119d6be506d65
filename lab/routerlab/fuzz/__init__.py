"""`prefix-router fuzz`: hostile request bodies through normalise, key, pick and precise mode; nothing may escape.

``decide()`` promises never to raise for any body or headers, the pick path builds on
whatever it returns, and precise mode's tokenising either gives token ids or refuses with
NotTokenizable. This command holds all three to that. ``documents`` builds well-formed
requests, ``hostile_docs`` the documents precise mode walks, ``shapes`` turns them (and raw
bytes) into hostile ones, ``checks`` says what any decision and pick must satisfy,
``precise`` what precise mode's calls must, and ``runner`` runs, times and reports them (the
command).
"""

from routerlab.fuzz.runner import add_arguments, run

__all__ = ["add_arguments", "run"]
