"""Config of the orchestrator (`tandem orchestrator`).

The sections here (`client`, `sampling`, `envs`, `EvalSettings`) are also the building blocks of
`tandem eval` (`tandem/config/eval.py`), so each default is written once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from tandem.config.base import ProcessCheckpointConfig, ProcessConfig, PrometheusConfig, Section
from tandem.config.inference import ServerConfig
from tandem.config.secret import Secret
from tandem.config.weight_transport import FilesystemWeightTransport, WeightTransportConfig


class ClientConfig(Section):
    base_urls: list[str] = Field(default_factory=lambda: [ServerConfig().url])
    """Inference servers, as `http://host:port` (no `/v1`); requests are spread over all of them.
    The default is the address a default `tandem inference` listens on."""

    backend: Literal["tandem", "vllm"] = "tandem"
    """What serves `base_urls` (`inference.backend`; `tandem rl` sets it): their token-in routes and
    how they report policy versions differ (`tandem/orchestrator/server_dialect.py`)."""

    api_key: Secret = None
    """Sent as `Authorization: Bearer <api_key>` when set (the server's `server.api_key`). A secret: redacted
    wherever tandem writes or prints a config."""

    timeout_s: float = 600.0
    """Limit of one HTTP request; a long CPU generation must fit in it."""

    max_retries: int = 5
    """Retries of a request that met a transport error or a 5xx, rotating over the servers."""

    backoff_s: float = 0.5
    """Delay before the first retry; it doubles at each retry up to `max_backoff_s`."""

    max_backoff_s: float = 8.0
    """Longest delay between two retries."""

    health_timeout_s: float = 600.0
    """How long to wait at start for every server's `GET /health` to answer 200 (`tandem rl` waits
    as long for the server it starts)."""

    @model_validator(mode="after")
    def _check(self) -> "ClientConfig":
        if not self.base_urls:
            raise ValueError("`client.base_urls` is empty: give at least one inference server URL")
        for url in self.base_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"`client.base_urls` entry {url!r} must start with http:// or https://")
        if self.max_retries < 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("`client.max_retries`, `client.backoff_s` and `client.max_backoff_s` must be >= 0")
        return self


class SamplingConfig(Section):
    temperature: float = 1.0
    """Sampling temperature of training rollouts; the trainer divides logits by the same value."""

    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""

    top_k: int = -1
    """Keep the k most likely tokens (-1 = off)."""

    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (0 = off)."""

    max_tokens: int = 256
    """Most tokens of one model turn (also capped so prompt + turn fit in `seq_len`)."""

    stop: list[str] = []
    """Strings that end a model turn, on top of the tokenizer's end-of-turn token."""

    return_routed_experts: bool = False
    """Ask the servers for the experts that sampled each token (mixture-of-experts models on tandem's
    engine) and ship them to the trainer, which replays them with `loss.router_replay = true`."""

    seeded: bool = False
    """Give each training rollout its own sampling seed (from the run seed and the task's draw
    number; each turn of a multi-turn rollout its own seed drawn from that one), so that a synchronous
    run (`max_async_level = 0`) repeats its rollouts exactly: for comparing two runs that should agree
    (weight transports, backends), not for training."""

    def request_args(self) -> dict[str, Any]:
        """The keyword arguments an environment passes to `chat.completions.create` (the rollout client
        itself asks for routed experts and seeds training rollouts)."""
        return self.model_dump(exclude={"return_routed_experts", "seeded"})


class EnvConfig(Section):
    id: str
    """Environment id: `load_environment(id, **args)` imports the installed module named after it."""

    args: dict[str, Any] = {}
    """Keyword arguments of the environment's `load_environment`."""

    weight: float = 1.0
    """Relative share of this environment's tasks in the training mix."""

    name: str | None = None
    """Label in metrics and sample files; defaults to `id` (set it to use one id twice)."""

    @property
    def label(self) -> str:
        return self.name or self.id


class AdvantageConfig(Section):
    std_normalize: bool = False
    """Divide each group's advantages by the group's reward standard deviation."""

    length_penalty: float = 0.0
    """Subtracted from a rollout's reward per completion token, as `length_penalty * tokens / sampling.max_tokens`."""

    filter_zero_groups: bool = True
    """Replace groups whose advantages are all zero (every rollout scored the same): they teach nothing."""

    max_replacement_ratio: float = 1.0
    """At most this times `batch_size / group_size` replacement groups per step (for filtered or failed
    groups); past that the step is filled with the filtered groups so the run keeps going."""


class EvalSettings(Section):
    num_examples: int = 32
    """Eval examples per environment, the same seeded choice each time (-1 = the whole eval split)."""

    rollouts_per_example: int = 4
    """Rollouts of each example: the n of pass@k, reported for k = 1, 2, 4, ... up to n."""

    pass_threshold: float = 1.0
    """A rollout passes when its reward is at least this."""

    temperature: float | None = None
    """Sampling temperature of evals (0 = greedy); None = `sampling.temperature`."""

    seeded: bool = True
    """Give each eval rollout its own sampling seed (from the run seed, the example and the rollout;
    each turn of a multi-turn rollout its own seed drawn from that one), so that the same policy gets
    the same eval reward however the server batches the requests."""

    @model_validator(mode="after")
    def _check(self) -> "EvalSettings":
        if self.rollouts_per_example < 1:
            raise ValueError(f"`eval.rollouts_per_example` must be >= 1, got {self.rollouts_per_example}")
        if self.num_examples == 0 or self.num_examples < -1:
            raise ValueError(f"`eval.num_examples` must be >= 1 or -1 (all), got {self.num_examples}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"`eval.temperature` must be >= 0, got {self.temperature}")
        return self


class OrchestratorEvalConfig(EvalSettings):
    interval: int = 10
    """Evaluate every `interval` policy versions, at start (policy 0) and after the last step; 0 = never."""


class WeightWatchConfig(Section):
    """How the orchestrator notices the trainer's newly published policies."""

    poll_interval_s: float = 0.2
    """How often to look for a new `weights/step_N/STABLE`."""

    wait_timeout_s: float | None = None
    """Give up when the trainer publishes nothing for this long while the orchestrator waits on it (None = never)."""


class FilesystemTransportConfig(Section):
    type: Literal["filesystem"] = "filesystem"
    """`rollouts/step_N/rank_R.msgpack` files in the run folder, written atomically."""


class ProbeConfig(Section):
    """The probe of the preflight that `tandem rl` runs before step 1 (`tandem orchestrator-preflight`):
    conversations sampled by the first server, packed for the trainer to recompute."""

    num_conversations: int = Field(4, ge=1)
    """Probe conversations, each of two model turns (the second turn tests the chat-template prefix rule)."""

    max_tokens: int = Field(16, ge=1)
    """Most tokens of each probe turn."""


class OrchestratorConfig(ProcessConfig):
    """Root config of the orchestrator."""

    client: ClientConfig = ClientConfig()
    """The inference servers."""

    prometheus: PrometheusConfig = PrometheusConfig()
    """Prometheus `/metrics` of the orchestrator."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings of training rollouts."""

    envs: list[EnvConfig] = Field(default_factory=lambda: [EnvConfig(id="reverse_text")])
    """Training environments and their mix weights."""

    batch_size: int = 32
    """Rollouts per training step; a multiple of `group_size`."""

    group_size: int = 8
    """Rollouts of the same task whose rewards are compared to compute advantages."""

    max_async_level: int = 1
    """Batch n may be sampled by policy n-1-max_async_level or newer; 0 = synchronous on-policy RL."""

    max_off_policy_steps: int = 8
    """A sample whose oldest turn is older than policy n-1-max_off_policy_steps is dropped from batch n."""

    max_concurrent_rollouts: int = 64
    """Most rollouts in flight at once, over all servers (rounded to whole groups, at least one)."""

    num_trainer_ranks: int = 1
    """Trainer processes: one batch file per rank per step, all with the same number of rows."""

    advantage: AdvantageConfig = AdvantageConfig()
    """How rewards become advantages."""

    eval: OrchestratorEvalConfig = OrchestratorEvalConfig()
    """Evaluations during the run, on each environment's eval split."""

    ckpt: ProcessCheckpointConfig = ProcessCheckpointConfig()
    """Checkpoints of the orchestrator's progress (step, data position)."""

    weights: WeightWatchConfig = WeightWatchConfig()
    """Watching the trainer's published policies."""

    transport: FilesystemTransportConfig = FilesystemTransportConfig()
    """How batches reach the trainer."""

    weight_transport: WeightTransportConfig = FilesystemWeightTransport()
    """How new policies reach the inference servers (the trainer's `weight_transport`, same value)."""

    preflight: ProbeConfig = ProbeConfig()
    """The preflight's probe (`tandem orchestrator-preflight`); `tandem rl` copies its `preflight` keys here."""

    @model_validator(mode="after")
    def _check(self) -> "OrchestratorConfig":
        if self.group_size < 1:
            raise ValueError(f"`group_size` must be >= 1, got {self.group_size}")
        if self.batch_size < 1 or self.batch_size % self.group_size:
            raise ValueError(
                f"`batch_size` = {self.batch_size} must be a positive multiple of `group_size` = {self.group_size}"
            )
        if self.max_async_level < 0:
            raise ValueError(f"`max_async_level` must be >= 0, got {self.max_async_level}")
        if self.max_off_policy_steps < self.max_async_level:
            raise ValueError(
                f"`max_off_policy_steps` = {self.max_off_policy_steps} is below `max_async_level` = "
                f"{self.max_async_level}: it would drop samples the async bound allows; set it >= {self.max_async_level}"
            )
        if self.num_trainer_ranks < 1:
            raise ValueError(f"`num_trainer_ranks` must be >= 1, got {self.num_trainer_ranks}")
        if self.max_concurrent_rollouts < 1:
            raise ValueError(f"`max_concurrent_rollouts` must be >= 1, got {self.max_concurrent_rollouts}")
        if self.sampling.temperature <= 0:
            raise ValueError(
                f"`sampling.temperature` = {self.sampling.temperature}: training needs a temperature > 0 "
                "(the trainer divides logits by it); use `eval.temperature` for greedy evals"
            )
        if self.sampling.max_tokens < 1:
            raise ValueError(f"`sampling.max_tokens` must be >= 1, got {self.sampling.max_tokens}")
        check_envs(self.envs)
        if self.advantage.max_replacement_ratio < 0:
            raise ValueError("`advantage.max_replacement_ratio` must be >= 0")
        if self.eval.interval < 0:
            raise ValueError(f"`eval.interval` must be >= 0 (0 = never), got {self.eval.interval}")
        transport = self.weight_transport
        if transport.type == "broadcast" and transport.num_inference_ranks % len(self.client.base_urls):
            raise ValueError(
                f"`weight_transport.num_inference_ranks` = {transport.num_inference_ranks} is not a multiple of the "
                f"{len(self.client.base_urls)} `client.base_urls`: every server must hold the same number of ranks"
            )
        return self


def check_envs(envs: list[EnvConfig]) -> None:
    """Raise a `ValueError` naming the bad `envs` entry: none, a weight <= 0, or a repeated label."""
    if not envs:
        raise ValueError("`envs` is empty: give at least one environment, e.g. envs = [{id = \"reverse_text\"}]")
    seen: set[str] = set()
    for i, env in enumerate(envs):
        if env.weight <= 0:
            raise ValueError(f"`envs[{i}].weight` must be > 0, got {env.weight}")
        if env.label in seen:
            raise ValueError(f"`envs[{i}]`: the label {env.label!r} appears twice; give each a distinct `name`")
        seen.add(env.label)
