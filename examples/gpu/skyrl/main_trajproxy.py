"""SkyRL's GRPO trainer with trajproxy's generator: unmodified agents in Docker sandboxes on this node, their calls
answered by SkyRL's own inference engines, each trajectory a graded episode (integrations/skyrl.py).

    bash examples/gpu/skyrl/run.sh          # the few-step run; its flags are SkyRL's own

Built as SkyRL's Harbor integration is (examples/train_integrations/harbor in the SkyRL repository): SkyRL's config
with one more section, `trajproxy` (agent, database_url, max_concurrency, ...), and `BasePPOExp.get_generator`
returning the generator. The generator lives in the training loop's Ray task: that node needs Docker and the task
images (or their build contexts).
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any

import ray
from skyrl.backends.skyrl_train.inference_servers.utils import resolve_policy_model_name
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.entrypoints.main_base import BasePPOExp
from skyrl.train.utils import validate_cfg
from skyrl.train.utils.utils import initialize_ray

from integrations.skyrl import TrajproxyGenerator


@dataclass
class TrajproxySkyRLConfig(SkyRLTrainConfig):  # type: ignore[misc]
    """SkyRL's config and the generator's options (TrajproxyGenerator's keyword arguments)."""

    trajproxy: dict[str, Any] = field(default_factory=dict)


class TrajproxyExp(BasePPOExp):  # type: ignore[misc]
    def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> TrajproxyGenerator:
        options = {"agent": "minimal", "run_name": cfg.trainer.run_name, **cfg.trajproxy}
        self.generator = TrajproxyGenerator(
            inference_engine_client,
            tokenizer=cfg.trainer.policy.model.path,
            model=resolve_policy_model_name(cfg),  # the name SkyRL's own generator samples (a LoRA adapter's too)
            step_wise=cfg.generator.step_wise_trajectories,
            overlong_filtering=cfg.generator.apply_overlong_filtering,
            use_cache_salt=cfg.generator.use_cache_salt,
            max_total_length=cfg.generator.max_input_length,
            **options,
        )
        return self.generator

    def run(self) -> None:
        try:
            super().run()
        finally:  # the embedded trajproxy and any sandbox still up
            generator = getattr(self, "generator", None)
            if generator is not None:
                asyncio.run(generator.aclose())


@ray.remote(num_cpus=1)
def skyrl_entrypoint(cfg: TrajproxySkyRLConfig) -> None:
    TrajproxyExp(cfg).run()


def main() -> None:
    cfg = TrajproxySkyRLConfig.from_cli_overrides(sys.argv[1:])
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(skyrl_entrypoint.remote(cfg))


if __name__ == "__main__":
    main()
