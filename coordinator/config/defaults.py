"""The text ``tuneplane-coordinator init`` writes to ``coordinator.toml``, and its ``[store]``
table.

Rules:
- The file is written once by ``tuneplane-coordinator init`` and edited by the people who run the
  coordinator, so every table and key it may hold is explained in the file itself.
"""

from __future__ import annotations

from ..store_location import PostgresUrl

CONFIG_NAME = "coordinator.toml"

DEFAULT_CONFIG = """\
# TunePlane coordinator configuration: the Series (classes of accelerator) and the Profiles
# (named presets over a Series) that `tp submit --profile` takes.
#
# [series.<name>]
#   cards             how many cards of this Series exist in the deployment (0: not counted)
#   accelerator       false for a Series that has no GPUs (Jobs on it ask for 0 GPUs)
# [profiles.<name>]
#   series            the Series this Profile runs on
#   gpus_per_member   the default shape: GPUs per member when the JobSpec leaves it out
#   fleet             the Fleet Jobs with this Profile are placed onto
#   env               environment variables this shape needs
# [quota.<fleet>]     optional: per Series, the most GPUs Jobs may hold at once in that Fleet,
#   h200 = 4          e.g. a fifth h200 GPU waits ("waiting: quota h200 4/4 in use")
# [credentials]       optional: how long credentials live (a whole number and s, m, h or d)
#   node_lifetime = "30d"        a Node's control credential; renewed in its second half
#   user_token_lifetime = "90d"  the default of `user create --expires-in`
# [limits]            optional: bounds on what callers may send (docs/security.md)
#   api_message_bytes = 16777216        one message on the API listener (a Preview carries
#                                       up to 8 MiB of experiment files, base64-encoded)
#   control_message_bytes = 4194304     one message on the control listener
#   telemetry_message_bytes = 3145728   one Ship batch on the telemetry listener
#   enroll_message_bytes = 65536        one Enroll (unauthenticated)
#   enroll_burst = 20                   Enroll calls one address may make at once,
#   enroll_per_second = 2.0             and then per second (enroll_burst = 0: no limit)
#   connects_at_once = 256              Node Connects worked on at once in a reconnect storm;
#   connect_wait_s = 5.0                the others wait this long for their turn, then are
#                                       refused as busy and dial again at the turn named
#   connect_queue_s = 60.0              a Node whose agent can wait in line (0.2.0 and later)
#                                       is told its place and waits up to this long instead
#                                       (0: no line)
# [fleet.<name>]     optional: per Fleet
#   max_disconnect = "2h"     declare a Node lost when it holds members and stays disconnected
#                             this long (off unless set; docs/operator.md, "A Node that never
#                             comes back", says what it risks)
#   shared_output_root = "/mnt/tp-out"  a directory every Node of the Fleet mounts at this
#                             path and uses as its output root (node.toml out_root): a run
#                             whose outputs lie under it can be an --init-from source
#                             (docs/researcher.md, "Starting from another run")
# [fleet.<name>.registries."<host[:port]>"]  optional: a registry whose images Jobs on this
#                             Fleet may run (`image:<registry>/<name>:<tag>` or `@sha256:...`);
#                             an image from a registry the Fleet does not list is refused at
#                             Preview, where a tag is resolved to its digest (docs/operator.md,
#                             "Registries"). Every key is optional:
#   ca_file = "/etc/tuneplane/registry-ca.pem"    the CA that signed the registry's certificate
#                             (default: the system's CA bundle; TLS is always verified)
#   username = "tuneplane"    the account Preview reads manifests as, with
#   password_file = "/etc/tuneplane/registry.password"   the file holding its password (read
#                             at each Preview, never printed or logged)
#   timeout_s = 10            how long a Preview waits for this registry
# [runtimes."<runtime id>"]  optional: what Jobs on one runtime may do
#   allow_loader_env = true   a JobSpec's env may set LD_*, PYTHONPATH and their kin on this
#                             runtime (refused at Preview otherwise); the Node decides again
#                             with allow_loader_env in its node.toml
# [metrics]           optional: serve Prometheus metrics over plain HTTP (off without the table;
#   port = 7446       docs/operator.md, "Metrics", lists them)
#   host = "127.0.0.1"        the address to listen on (default: this machine only)
# [addresses]         optional: the addresses serve hands out (endpoints.json, tp-context.json,
#                     the telemetry address in every Commit); docs/operator.md, "Addresses"
#   host = "coordinator.example.org"   every listener at this name or address (serve
#                     --advertise wins); needed when serve listens on 0.0.0.0 or ::
#   control = "lb.example.org:7444"    one listener at a whole HOST:PORT (a NAT or a load
#                     balancer in front); also api = ... and telemetry = ...
# [store]             optional: keep the coordinator's state in a PostgreSQL database instead of
#                     the SQLite files in this directory (`init --store` writes it; `serve
#                     --store` overrides it for one run; docs/operator.md, "PostgreSQL store")
#   url = "postgresql://tuneplane@db.example.org:5432/tuneplane"
#                     leave the password out: the driver reads PGPASSWORD and ~/.pgpass, as
#                     psql does, and the coordinator never prints or logs it

[series.h200]
cards = 0
accelerator = true

[series.h100]
cards = 0
accelerator = true

[series.cpu]
cards = 0
accelerator = false

[profiles.h200]
series = "h200"
fleet = "default"

[profiles.h200-2g]
series = "h200"
gpus_per_member = 2
fleet = "default"

[profiles.h100]
series = "h100"
fleet = "default"

[profiles.cpu]
series = "cpu"
fleet = "default"
"""


def store_table(url: PostgresUrl) -> str:
    """The ``[store]`` table ``init --store`` appends to coordinator.toml."""
    return (
        "\n[store]\n"
        "# Written by `tuneplane-coordinator init --store`: the stores live in this PostgreSQL\n"
        "# database. Keep the password out of this file: the driver reads PGPASSWORD and\n"
        "# ~/.pgpass. `serve --store URL` overrides this for one run.\n"
        f"url = {_toml_string(url.dsn())}\n"
    )


def _toml_string(text: str) -> str:
    """``text`` as a TOML basic string (a checked URL: printable ASCII, no control characters)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
