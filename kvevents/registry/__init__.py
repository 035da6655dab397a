"""A local schema registry (Apicurio Registry's Confluent-compatible API) without Docker.

``kvevents registry start|stop|status|fetch`` and the test fixtures use :class:`LocalRegistry`;
its URL (``http://127.0.0.1:PORT/apis/ccompat/v7``) goes to ``--schema-registry-url``.
"""

from .dist import (
    APICURIO_VERSION,
    RegistryDistribution,
    RegistryFetchError,
    ensure_registry,
    find_registry_java,
)
from .process import (
    CCOMPAT_PATH,
    LocalRegistry,
    RegistryError,
    RegistryStatus,
    default_registry_dir,
    registry_answers,
)

__all__ = [
    "APICURIO_VERSION",
    "CCOMPAT_PATH",
    "LocalRegistry",
    "RegistryDistribution",
    "RegistryError",
    "RegistryFetchError",
    "RegistryStatus",
    "default_registry_dir",
    "ensure_registry",
    "find_registry_java",
    "registry_answers",
]
