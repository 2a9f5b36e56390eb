"""The router's cached, incrementally invalidated recipient sets against a model.

A hypothesis state machine attaches and detaches endpoints, subscribes and
unsubscribes (instances and Hat patterns, every subtype) and routes
messages; after every step the router's answer (through its cache) must
equal the send rules of BROKER-SPEC section 1 evaluated from scratch on a
plain model of the subscriptions.  This guards the per-group cache
invalidation and the per-group tables used for instance "*" sends.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from broker.core.eventtypes import STAR, matches
from broker.core.refusals import TooManySubscriptions
from broker.core.router import MEONLY, NORMAL, PROMISC, Endpoint, Routed, Router
from tests.fuzz.conftest import PROFILE, tally

GROUPS = [b"a", b"b", b"c"]
INSTANCES = [b"*", b"x", b"y", b"x/1"]
PATTERNS = [(b"a", b"*"), (b"*",), (b"?", b"x"), (b"b",), (b"a", b"x", b"1"), (b"c", b"?")]
SUBTYPES = [NORMAL, MEONLY, PROMISC]


class Sink(Endpoint):
    def deliver(self, frame: bytes, routed: Routed) -> None:
        pass


def event_type(group: bytes, instance: bytes) -> tuple[bytes, ...]:
    return (group,) if instance == STAR else (group, *instance.split(b"/"))


def subscribed(subscribe, *args) -> bool:
    """True when ``subscribe(*args)`` subscribed, False when it refused the
    subscription for passing max_subscriptions (the only refusal here)."""
    try:
        subscribe(*args)
    except TooManySubscriptions:
        return False
    return True


class RouterModel(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.router = Router(hostname="model", max_subscriptions=6)
        self.live: list[Sink] = []
        self.gone: list[Sink] = []
        # the model: endpoint -> {(group, instance): subtype}, {pattern: subtype}
        self.subs: dict[Sink, dict[tuple[bytes, bytes], int]] = {}
        self.pats: dict[Sink, dict[tuple[bytes, ...], int]] = {}
        for _ in range(3):
            self.attach()

    # ---- the model's send rules, from scratch ---------------------------------

    def expected(self, group: bytes, instance: bytes, to: bytes, reply: bool) -> set[Sink]:
        out: set[Sink] = set()
        for ep in self.live:
            held = [st for (g, i), st in self.subs[ep].items() if g == group and (
                instance == STAR or i in (instance, STAR))]
            if to == STAR:
                if any(s != MEONLY for s in held):
                    out.add(ep)
            else:
                if ep.lname == to and (reply or any(s != PROMISC for s in held)):
                    out.add(ep)
                if any(s == PROMISC for s in held):
                    out.add(ep)
            etype = event_type(group, instance)
            for pat, s in self.pats[ep].items():
                if matches(pat, etype) and (
                    s == PROMISC or (s == NORMAL and to == STAR) or to == ep.lname
                ):
                    out.add(ep)
        return out

    # ---- rules -----------------------------------------------------------------

    @rule()
    def attach(self) -> None:
        ep = Sink()
        self.router.attach(ep)
        self.live.append(ep)
        self.subs[ep] = {}
        self.pats[ep] = {}

    @rule(data=st.data())
    def detach(self, data) -> None:
        if len(self.live) > 1:
            ep = data.draw(st.sampled_from(self.live))
            self.router.detach(ep)
            self.live.remove(ep)
            self.gone.append(ep)
            del self.subs[ep], self.pats[ep]

    @rule(data=st.data(), group=st.sampled_from(GROUPS), instance=st.sampled_from(INSTANCES),
          subtype=st.sampled_from(SUBTYPES))
    def subscribe(self, data, group, instance, subtype) -> None:
        ep = data.draw(st.sampled_from(self.live))
        held = self.subs[ep]
        fits = (group, instance) in held or len(held) + len(self.pats[ep]) < 6
        assert subscribed(self.router.subscribe, ep, group, instance, subtype) == fits
        if fits:
            held[(group, instance)] = subtype

    @rule(data=st.data(), group=st.sampled_from(GROUPS), instance=st.sampled_from(INSTANCES))
    def unsubscribe(self, data, group, instance) -> None:
        ep = data.draw(st.sampled_from(self.live))
        self.router.unsubscribe(ep, group, instance)
        self.subs[ep].pop((group, instance), None)

    @rule(data=st.data(), pattern=st.sampled_from(PATTERNS), subtype=st.sampled_from(SUBTYPES))
    def subscribe_pattern(self, data, pattern, subtype) -> None:
        ep = data.draw(st.sampled_from(self.live))
        pats = self.pats[ep]
        fits = pattern in pats or len(self.subs[ep]) + len(pats) < 6
        assert subscribed(self.router.subscribe_pattern, ep, pattern, subtype) == fits
        if fits:
            pats[pattern] = subtype

    @rule(data=st.data(), pattern=st.sampled_from(PATTERNS))
    def unsubscribe_pattern(self, data, pattern) -> None:
        ep = data.draw(st.sampled_from(self.live))
        self.router.unsubscribe_pattern(ep, pattern)
        self.pats[ep].pop(pattern, None)

    @rule(data=st.data(), group=st.sampled_from(GROUPS), instance=st.sampled_from(INSTANCES),
          reply=st.booleans())
    def lookup(self, data, group, instance, reply) -> None:
        """Route (through the cache) to "*", to a live or departed lname, or to nobody."""
        everyone = self.live + self.gone
        to = data.draw(st.one_of(st.just(STAR), st.just(b"nobody"),
                                 st.sampled_from(everyone).map(lambda e: e.lname)))
        got = set(self.router.recipients(group, instance, to, reply))
        tally("router model", "lookups")
        assert got == self.expected(group, instance, to, reply), (group, instance, to, reply)

    # ---- invariants --------------------------------------------------------------

    @invariant()
    def every_cached_set_is_current(self) -> None:
        for (group, instance, to, reply), recips in list(self.router._cache.items()):
            assert set(recips) == self.expected(group, instance, to, reply)

    @invariant()
    def counts_match(self) -> None:
        r = self.router
        assert r.subscription_count == sum(len(s) for s in self.subs.values()) + sum(
            len(p) for p in self.pats.values())
        assert r.stats()["connections"] == {"skan": len(self.live)}


RouterModel.TestCase.settings = settings(
    settings.get_profile(PROFILE), stateful_step_count=40,
)
TestRouterModel = RouterModel.TestCase
