"""Which replicas serve which model (pure): the pools a request is picked among.

A vLLM process serves one base model, under its served name(s), and the LoRA adapters loaded on
it; a request names one of them in ``model``. With ``--pools`` the router is told each base
model's replicas; each replica's ``/v1/models`` then says what else it answers to (more served
names, and adapters, whose ``parent`` is the base model). A request is picked only among the
replicas of the pool its model belongs to: an adapter's is its base model's pool, whichever
replica has loaded it. A model no pool answers to is not picked (Envoy's load balancer
chooses), nor is a request without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

NO_MODEL: Final = "no_model"  # the request names no model: no pool to pick in
UNKNOWN_MODEL: Final = "unknown_model"  # no pool serves the model it names
EVERY_MODEL: Final = ""  # the one pool without --pools: every replica serves every model


class Served(NamedTuple):
    """One model card of a replica's /v1/models: its id and its parent (None: a base model)."""

    id: str
    parent: str | None = None


class Pools:
    """Each pool's replicas and the names each answers to; ``resolve`` maps a request's model to
    its pool. Updated from the endpoint sources (``set_members``) and ``/v1/models`` (``served``).

    No names (no ``--pools``): one pool, ``EVERY_MODEL``, which every request is picked in, as
    before pools; /v1/models still says which names are adapters (``base_of``)."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        self.order: tuple[str, ...] = tuple(names)  # the configured order: the first pool wins a shared name
        self.named = bool(self.order)
        if not self.named:
            self.order = (EVERY_MODEL,)
        self.members: dict[str, frozenset[str]] = {name: frozenset() for name in self.order}
        self.models: dict[str, tuple[Served, ...]] = {}  # replica -> what its /v1/models lists
        self._names: dict[str, str] = {}
        self._parents: dict[str, str] = {}  # adapter -> its base model
        self._rebuild()

    def set_members(self, pool: str, addresses: Iterable[str]) -> None:
        self.members[pool] = frozenset(addresses)
        for address in set(self.models) - self.addresses():
            del self.models[address]
        self._rebuild()

    def served(self, address: str, models: Iterable[Served]) -> bool:
        """What ``address`` serves now (its /v1/models); returns whether anything changed."""
        models = tuple(models)
        if self.models.get(address) == models or address not in self.addresses():
            return False
        self.models[address] = models
        self._rebuild()
        return True

    def addresses(self) -> set[str]:
        """Every pool's replicas together."""
        return set().union(*self.members.values())

    def pool_of(self, address: str) -> str | None:
        return next((name for name in self.order if address in self.members[name]), None)

    def resolve(self, model: str | None) -> tuple[str | None, str | None]:
        """The pool ``model`` is served by, or None and why (``NO_MODEL``, ``UNKNOWN_MODEL``)."""
        if not self.named:
            return EVERY_MODEL, None
        if model is None:
            return None, NO_MODEL
        pool = self._names.get(model)
        return (pool, None) if pool is not None else (None, UNKNOWN_MODEL)

    def base_of(self, model: str) -> str | None:
        """The base model of the LoRA adapter ``model`` (None: not an adapter any replica lists)."""
        return self._parents.get(model)

    def _rebuild(self) -> None:
        names: dict[str, str] = {}
        parents: dict[str, str] = {}
        if self.named:
            for pool in self.order:
                names.setdefault(pool, pool)
        for pool in self.order:
            for address in sorted(self.members[pool]):
                for card in self.models.get(address, ()):
                    names.setdefault(card.id, pool)
                    if card.parent is not None:
                        parents.setdefault(card.id, card.parent)
        self._names, self._parents = names, parents

    def state(self) -> dict[str, object]:
        """The pools as JSON (``/debug/state``)."""
        return {"pools": {pool: sorted(self.members[pool]) for pool in self.order},
                "models": dict(sorted(self._names.items())),
                "served": {address: [list(card) for card in cards] for address, cards in sorted(self.models.items())}}
