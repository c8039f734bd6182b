"""``coordinator.toml``: the Series and Profiles this coordinator knows, its limits, addresses and
store, read with tomllib.

Rules:
- The file is written once by ``tuneplane-coordinator init`` (:mod:`.defaults`) and edited by the
  people who run the coordinator; a typo is a :class:`ConfigError` naming the file, the key and
  the fix (:mod:`.load`, :mod:`.tables`).
- A Profile is a preset over exactly one Series; it never invents hardware the Series lacks
  (:mod:`.values`).

This front door names what callers use; the package reads as values (what the file says) <-
tables (one reader per optional table) <- load (the whole file), with the initial text beside.
"""

from .defaults import CONFIG_NAME as CONFIG_NAME
from .defaults import DEFAULT_CONFIG as DEFAULT_CONFIG
from .defaults import store_table as store_table
from .load import load_config as load_config
from .load import parse_config as parse_config
from .load import store_setting as store_setting
from .values import AddressSettings as AddressSettings
from .values import ConfigError as ConfigError
from .values import ConsoleSettings as ConsoleSettings
from .values import CoordinatorConfig as CoordinatorConfig
from .values import FleetSettings as FleetSettings
from .values import Limits as Limits
from .values import Profile as Profile
from .values import RegistrySettings as RegistrySettings
from .values import RuntimeSettings as RuntimeSettings
from .values import Series as Series
from .values import parse_duration as parse_duration
