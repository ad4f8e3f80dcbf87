"""The router's worker pools: encoders, prefill+decode, prefill and decode workers; how they
join (the command line, DNS names resolved again and again, registrations with heartbeats; a
worker not on the command line only from the worker networks and with proof of the cluster
credential, ``router.membership``) and leave (eviction when a registration lapses or a name no
longer resolves); the probe loop that keeps their health, load reports, KV digests and the served
model current; and the HTTP clients every internal call goes through, each call signed
(``signed``: ``security.peers``): aiohttp's session for probes, registration and metrics, the
lean client (``api.http_client``) for the calls on a request's path (``call``, ``http``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

import aiohttp
import msgspec
from aiohttp import web

from epdserve.api.errors import BadRequest, Forbidden
from epdserve.api.http import read_body
from epdserve.api.http_client import HttpClient
from epdserve.api.kv_digest import MAX_DIGEST_BYTES, decode_digest
from epdserve.api.load import MAX_LOAD_REPORT_BYTES, decode_load_report, recommended_replicas
from epdserve.api.metrics import Metrics
from epdserve.api.registration import HEARTBEATS_PER_LEASE
from epdserve.router.config import RouterConfig
from epdserve.router.discovery import MAX_HEARTBEAT_S, DnsSource, Leases, is_worker_url, split_sources
from epdserve.router.kv_routing import KVIndex
from epdserve.router.membership import NotAllowed, WorkerNetworks, prove
from epdserve.router.pool import Policy, Worker, WorkerPool
from epdserve.router.vllm_worker import MAX_METRICS_BYTES, parse_vllm_load
from epdserve.security.peers import sign

log = logging.getLogger(__name__)

FAST_PROBE_S = 0.1  # probe period while no worker is healthy, or at start-up until all have been
MAX_REFUSED = 4096  # refused workers remembered (to log each once)
MAX_CALL_ANSWER_BYTES = 8 << 20  # an encoder's or a release's answer: metadata and handles, never tensors
RELEASE_TIMEOUT_S = 10.0  # giving a lease back; past it the lease expires by its TTL
STARTUP_PROBE_S = 60.0  # how long start-up's fast probing waits for workers named but not yet up


class WorkerPools:
    """The four pools and everything that keeps them current."""

    def __init__(self, config: RouterConfig, metrics: Metrics, tick: Callable[[], None] | None = None) -> None:
        self.config = config
        assert config.auth.cluster is not None  # checked by RouterConfig
        self.cluster = config.auth.cluster
        self.networks = WorkerNetworks.of(config.worker_networks, config.host)  # where workers may join from
        self._refused: set[tuple[str, str]] = set()  # (role, url) refused admission, not yet admitted
        # kv_aware chooses by cached prefix itself; the pools balance load when no prefix is known
        policy: Policy = "least_outstanding" if config.policy == "kv_aware" else config.policy
        self.dns: list[tuple[WorkerPool, DnsSource]] = []  # names resolved again every dns_interval_s
        self._dns_urls: dict[tuple[str, DnsSource], set[str]] = {}  # the workers each source added
        self._dns_at = 0.0
        self.static: set[tuple[str, str]] = set()  # (role, url) from the command line: never evicted
        self.leases = Leases()  # registrations with heartbeats

        def pool(role: str, entries: tuple[str, ...], policy: Policy) -> WorkerPool:
            urls, sources = split_sources(entries)
            p = WorkerPool(role, urls, policy)
            self.static |= {(role, w) for w in p.workers}
            self.dns += [(p, src) for src in sources]
            return p

        self.encoders = pool("encoder", config.encoders, config.encoder_policy)
        self.pds = pool("pd", config.pds, policy)
        self.prefills = pool("prefill", config.prefills, policy)
        self.decodes = pool("decode", config.decodes, policy)
        self.session: aiohttp.ClientSession | None = None  # probes, registration, metrics
        self.http = HttpClient()  # the calls on each request's path: encoders and language-model workers
        self._probe_task: asyncio.Task | None = None
        self.model: tuple[str, int] | None = None  # (served name, max_model_len) of the PD workers
        self.tick = tick  # once per probe round (the admission controller's)
        self.kv_index: KVIndex | None = None  # kv_aware: the workers' prefix-cache digests
        if config.policy == "kv_aware":
            self.kv_index = kv_index = KVIndex(stale_s=3 * config.probe_interval_s + 1)
            metrics.gauge(
                "router_kv_workers_fresh",
                "workers whose KV digest is recent enough to route by",
                lambda: sum(kv_index.fresh(w.url) for w in self.lm_workers),
            )
        lm_pools = (self.pds, self.prefills, self.decodes)

        def lm_requests() -> dict[str, int]:
            workers = [w for pool in lm_pools for w in pool.workers.values()]
            return {"awaiting_first_token": sum(w.awaiting for w in workers),
                    "past_first_token": sum(w.outstanding - w.awaiting for w in workers)}  # fmt: skip

        m = metrics
        m.counts("router_lm_requests", "requests on the language-model workers, awaiting their first token "
                 "(media still encoding included) or past it", "state", lm_requests, monotonic=False)  # fmt: skip
        m.gauge("router_encoders_healthy", "healthy encoder workers", lambda: len(self.encoders.healthy))
        m.counts(
            "router_recommended_replicas",
            "replicas of each role that would serve its demand at the target utilization (autoscaling)",
            "role",
            self._replicas,
            monotonic=False,
        )
        m.counts(
            "router_load_ratio",
            "summed load ratio of each role's healthy workers (1 = one worker's capacity)",
            "role",
            lambda: {p.role: sum(w.load for w in p.healthy) for p in self.pools if p.workers},
            monotonic=False,
        )
        m.gauge("router_pds_healthy", "healthy PD workers", lambda: len(self.pds.healthy))
        m.gauge("router_prefills_healthy", "healthy prefill workers", lambda: len(self.prefills.healthy))
        m.gauge("router_decodes_healthy", "healthy decode workers", lambda: len(self.decodes.healthy))

    async def start(self) -> None:
        conn = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None))
        self._probe_started, self._all_seen = time.monotonic(), False
        self._probe_task = asyncio.create_task(self._probe_loop())

    def stop_probing(self) -> None:
        if self._probe_task:
            self._probe_task.cancel()

    async def close(self) -> None:
        self.http.close()
        if self.session:
            await self.session.close()

    async def _probe_loop(self) -> None:
        assert self.session is not None
        while True:
            try:
                await self._discover()
                await asyncio.gather(*(pool.probe(self.session) for pool in self.pools))
                if self.model is None:
                    await self.learn_model()
                if self.kv_index is not None:
                    await asyncio.gather(*(self._poll_digest(w) for w in (*self.pds.healthy, *self.prefills.healthy)))
                await asyncio.gather(*(self._poll_load(w) for pool in self.pools for w in pool.healthy))
                if self.tick is not None:
                    self.tick()
            except Exception:  # a probe round must never end the loop
                log.exception("health probe round failed")
            # while no worker can take a request (all down), and at start-up until every worker
            # named has answered once, probe often: the router uses a worker the moment it is up
            if not self._all_seen and time.monotonic() - self._probe_started < STARTUP_PROBE_S:
                self._all_seen = all(len(pool.healthy) == len(pool.workers) for pool in self.pools)
            else:
                self._all_seen = True
            # and while a role has no healthy worker, so media waiting for an encoder gets one soon
            fast = not self._all_seen or any(pool.workers and not pool.healthy for pool in self.pools)
            fast = fast or not (self.pds.healthy or self.splits)
            await asyncio.sleep(
                min(FAST_PROBE_S, self.config.probe_interval_s) if fast else self.config.probe_interval_s
            )

    async def _discover(self) -> None:
        """Workers from DNS (every ``dns_interval_s``), and registrations whose heartbeats stopped."""
        for role, url in self.leases.expired():
            if (role, url) not in self.static and self._pool(role).remove(url):
                log.warning("%s %s evicted: its registration was not renewed", role, url)
        now = time.monotonic()
        if not self.dns or now - self._dns_at < self.config.dns_interval_s:
            return
        self._dns_at = now
        found = await asyncio.gather(*(src.resolve() for _, src in self.dns))
        for (pool, src), urls in zip(self.dns, found, strict=True):
            before = self._dns_urls.get((pool.role, src), set())
            new = [url for url in urls - before if url not in pool.workers]
            refused = await asyncio.gather(*(self.admit(pool.role, url, f"found by {src}") for url in new))
            urls = urls - {url for url, why in zip(new, refused, strict=True) if why}  # asked again next time
            for url in urls - before:
                pool.add(url)
                log.info("%s %s found by %s", pool.role, url, src)
            for url in before - urls:
                if (pool.role, url) not in self.static and not self.leases.held(pool.role, url):
                    pool.remove(url)
                    log.info("%s %s gone from %s", pool.role, url, src)
            self._dns_urls[(pool.role, src)] = urls

    def signed(self, method: str, url: str, body: bytes = b"") -> dict[str, str]:
        """The proof of the cluster credential for one internal request (``security.peers``)."""
        return sign(self.cluster, method, url, body)

    async def call(
        self, url: str, body: bytes, timeout_s: float, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """A signed JSON POST to an epdserve worker on the lean client: its status and whole
        body (at most ``MAX_CALL_ANSWER_BYTES``). Raises ``TimeoutError`` past ``timeout_s``,
        ``OSError`` when it cannot be reached, breaks off or answers more."""
        signed = {"Content-Type": "application/json", **self.signed("POST", url, body), **(headers or {})}
        async with await self.http.post(url, body, signed, timeout_s) as resp:
            return resp.status, await resp.read(MAX_CALL_ANSWER_BYTES)

    async def release(self, url: str, body: bytes, what: str) -> bool:
        """Give leases back to the worker that issued them (``what``: e.g. "release 3 leases", for
        the log): whether it took them. Failures are logged, never raised: the leases expire by TTL."""
        try:
            status, _ = await self.call(url, body, RELEASE_TIMEOUT_S)
        except OSError as e:  # TimeoutError included
            log.warning("could not %s on %s (they expire by TTL): %s", what, url, e)
            return False
        if status != 200:
            log.warning("%s refused to %s (HTTP %d; they expire by TTL)", url, what, status)
            return False
        return True

    async def admit(self, role: str, url: str, why: str) -> str | None:
        """None when a worker not on the command line may join: its address is in the worker
        networks and it proves it holds the cluster credential; else the reason (logged)."""
        assert self.session is not None
        try:
            await self.networks.check(url)
            refused = await prove(self.session, self.cluster, url)
        except NotAllowed as e:
            refused = str(e)
        if refused is not None:  # said once per worker; a DNS name asks again every round
            level = logging.DEBUG if (role, url) in self._refused else logging.WARNING
            log.log(level, "%s %s (%s) kept out of the pool: %s", role, url, why, refused)
            if len(self._refused) >= MAX_REFUSED:
                self._refused.clear()  # a bound on what registrations can make the router hold
            self._refused.add((role, url))
        else:
            self._refused.discard((role, url))
        return refused

    async def get_internal(self, w: Worker, path: str, limit: int, timeout_s: float) -> bytes | None:
        """The body (at most ``limit`` bytes) of a worker's internal ``GET path``, None unless it
        answers 200; a worker that cannot be reached raises (aiohttp, timeout, OS errors)."""
        assert self.session is not None
        async with self.session.get(
            w.url + path, headers=self.signed("GET", w.url + path), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as r:
            return await r.content.read(limit) if r.status == 200 else None

    async def _poll_load(self, w: Worker) -> None:
        """A worker's load report (the last one is kept when it cannot say or says nonsense); a
        vLLM worker's from its Prometheus ``/metrics`` (``router.vllm_worker``)."""
        vllm = self.config.pd_engine == "vllm" and w.url in self.pds.workers
        try:
            if vllm:
                raw = await self.get_internal(w, "/metrics", MAX_METRICS_BYTES, 2)
                if raw is not None:
                    w.report = parse_vllm_load(raw.decode("utf-8", "replace")).report()
                return
            raw = await self.get_internal(w, "/v1/load", MAX_LOAD_REPORT_BYTES, 2)
            if raw is not None:
                w.report = decode_load_report(raw)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            pass

    def _replicas(self) -> dict[str, float]:
        """Per role with workers: the replicas that would serve its demand (api.load)."""
        return {
            pool.role: float(recommended_replicas([w.load for w in pool.healthy]))
            for pool in self.pools
            if pool.workers
        }

    async def _poll_digest(self, w: Worker) -> None:
        """A worker's prefix-cache digest into the KV index (a worker that cannot say goes stale)."""
        assert self.kv_index is not None
        try:
            raw = await self.get_internal(w, "/v1/kv/digest", MAX_DIGEST_BYTES + 1, 5)
            if raw is not None:
                self.kv_index.update(w.url, decode_digest(raw))
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.warning("no KV digest from %s: %s", w.url, e)

    @property
    def pools(self) -> tuple[WorkerPool, ...]:
        return (self.encoders, self.pds, self.prefills, self.decodes)

    @property
    def splits(self) -> bool:
        """Requests go E → P → D: healthy prefill and decode workers are there."""
        return bool(self.prefills.healthy and self.decodes.healthy)

    @property
    def lm_workers(self) -> list[Worker]:
        """Healthy language-model workers of every role."""
        return [*self.pds.healthy, *self.prefills.healthy, *self.decodes.healthy]

    # ---- the served model ----------------------------------------------------------------------
    async def pd_models(self) -> tuple[int, bytes] | None:
        """``GET /v1/models`` of the first healthy language-model worker that answers: (status, body)."""
        assert self.session is not None
        for pd in self.lm_workers:
            try:
                async with self.session.get(
                    pd.url + "/v1/models",
                    headers=self.signed("GET", pd.url + "/v1/models"),
                    timeout=aiohttp.ClientTimeout(total=5),
                ) as r:
                    return r.status, await r.read()
            except (aiohttp.ClientError, TimeoutError, OSError):
                continue
        return None

    async def learn_model(self) -> tuple[str, int] | None:
        """The served model's name and context length, as the PD workers report them."""
        answer = await self.pd_models()
        if answer is None or answer[0] != 200:
            return None
        try:
            card = msgspec.json.decode(answer[1])["data"][0]
            self.model = (str(card["id"]), int(card.get("max_model_len") or 0))
        except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError):
            return None
        return self.model

    def context_len(self) -> int | None:
        """The workers' context length, once learnt: no prompt is tokenized past it."""
        return self.model[1] if self.model is not None and self.model[1] else None

    # ---- admin -------------------------------------------------------------------------------
    async def register(self, request: web.Request) -> web.Response:
        """``POST``/``DELETE /v1/workers`` (admin key): add or remove a worker. With
        ``heartbeat_s`` the registration lapses unless renewed within that many seconds times
        ``HEARTBEATS_PER_LEASE`` (a worker's ``--register-with``); without, it stays."""
        info = await _json_body(request)
        pool = self._pool(info.get("role"))
        url = info.get("url")
        if not isinstance(url, str) or not is_worker_url(url):
            raise BadRequest("url must be a worker's base URL: http(s)://host:port", param="url")
        url = url.rstrip("/")
        heartbeat = info.get("heartbeat_s")
        if heartbeat is not None and (
            not isinstance(heartbeat, int | float)
            or isinstance(heartbeat, bool)
            or not 0 < heartbeat <= MAX_HEARTBEAT_S
        ):
            raise BadRequest(f"heartbeat_s must be a number in (0, {MAX_HEARTBEAT_S}]", param="heartbeat_s")
        if request.method == "DELETE":
            self.leases.drop(pool.role, url)
            if heartbeat is not None and (pool.role, url) in self.static:
                return web.json_response({"removed": False})  # a worker leaving: the command line's entry stays
            self.static.discard((pool.role, url))  # the admin's removal: whatever listed it
            return web.json_response({"removed": pool.remove(url)})
        if url not in pool.workers:
            refused = await self.admit(pool.role, url, "registering")
            if refused is not None:
                raise Forbidden(f"The worker was not registered: {refused}.")
        if heartbeat is not None and (pool.role, url) not in self.static:
            self.leases.renew(pool.role, url, HEARTBEATS_PER_LEASE * heartbeat)
        elif heartbeat is None:
            self.leases.drop(pool.role, url)  # registered by hand: it stays
        if url not in pool.workers:
            log.info("%s %s registered", pool.role, url)
        pool.add(url)
        return web.json_response({"registered": url, "role": pool.role})

    def _pool(self, role: object) -> WorkerPool:
        for pool in self.pools:
            if role == pool.role:
                return pool
        raise BadRequest("role must be one of 'encoder', 'pd', 'prefill', 'decode'", param="role")


async def _json_body(request: web.Request) -> dict:
    try:
        info = msgspec.json.decode(await read_body(request))
    except msgspec.DecodeError:
        raise BadRequest("body is not valid JSON") from None
    if not isinstance(info, dict):
        raise BadRequest("body must be a JSON object")
    return info
