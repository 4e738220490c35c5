"""The width cap (and K per width) in force, watched for live changes.

Precedence (gmlx/policy/caps.py): CLI flag > GMLX_MTP_WIDTH_CAP > user config > model default.
The engine asks every round; the decision is made again only when what it depends on changed
(the env value, the config file's stamp: an env read and one stat per round). A value broken
mid-run (a typo in GMLX_MTP_WIDTH_CAP or the user config) cannot stop requests being served: the
last valid cap stays, with one warning per bad value; at engine start the same value is an error.
"""

from __future__ import annotations

import warnings

from gmlx import switches
from gmlx.errors import ConfigError
from gmlx.policy import caps, user_config


class CapWatch:
    def __init__(self, cli_cap, model_key: str, defaults: dict, explicit_k: int | None, default_k: int):
        self.cli_cap = cli_cap
        self.model_key = model_key
        self.defaults = defaults  # the model's and drafter's part of resolve_cap (LoadedModel.cap_defaults)
        self.explicit_k = explicit_k  # EngineConfig.num_draft_tokens: wins over any calibration
        self.default_k = default_k
        self._stamp = self._inputs()
        self.current = self.decide()  # raises ConfigError: at engine start a broken value is an error
        self._errors: set[str] = set()

    def decide(self) -> caps.CapDecision:
        """The decision from the current settings (reads the env and the user config now)."""
        return caps.resolve_cap(cli_cap=self.cli_cap, env_cap=switches.WIDTH_CAP.value(), model_key=self.model_key,
                                **self.defaults)

    @staticmethod
    def _inputs() -> tuple:
        return switches.WIDTH_CAP.raw(), user_config.config_stamp()

    def read(self) -> caps.CapDecision:
        """The next round's decision: the one in force unless the env or the config file changed.
        The engine puts it in force (`current`) once the round's cancellations are reaped; a
        distributed rank other than 0 puts rank 0's in force instead and never reads its own."""
        stamp = self._inputs()
        if stamp == self._stamp:
            return self.current
        self._stamp = stamp
        try:
            return self.decide()
        except ConfigError as e:
            if str(e) not in self._errors:
                self._errors.add(str(e))
                warnings.warn(f"gmlx: {e}; keeping the cap in force ({self.current.text})", RuntimeWarning,
                              stacklevel=3)
        return self.current

    def k_for(self, width: int) -> int:
        """Drafts per round at this width: the explicit setting, else a calibrated K per width
        (sweep-cap --write; 0 at width 1: lone requests decode plain), else the model's default."""
        if self.explicit_k is not None:
            return self.explicit_k
        return self.current.num_draft_tokens(width, self.default_k)
