"""Builds the optional compiled fast paths; everything else is in pyproject.toml.

Each extension is optional: when it cannot be built the package falls back to pure Python
(fastavro for the codec), slower but byte-for-byte the same.
"""

from pathlib import Path

from setuptools import Extension, setup

EXTENSIONS = [
    # the codec's modules before the one that cimports them (_fastcodec.pyx)
    ("kvevents.schemas._encode", "schemas/_encode.pyx"),
    ("kvevents.schemas._decode", "schemas/_decode.pyx"),
    ("kvevents.schemas._flat", "schemas/_flat.pyx"),
    ("kvevents.schemas._fastcodec", "schemas/_fastcodec.pyx"),
    ("kvevents.consumer._indexcore", "consumer/_indexcore.pyx"),
    ("kvevents.consumer._statejoin", "consumer/_statejoin.pyx"),
    ("kvevents.producer._fastrecorder", "producer/_fastrecorder.pyx"),
    ("kvevents.producer._gatherscan", "producer/_gatherscan.pyx"),
    ("kvevents.consumer.export._packtokens", "consumer/export/_packtokens.pyx"),
    ("kvevents.commands._route_fast", "kvevents/commands/_route_fast.pyx"),
    ("kvevents.producer.bridge._fastconvert", "producer/bridge/_fastconvert.pyx"),
]


PACKAGE_DIRS = {"schemas": "schemas", "producer": "producer", "consumer": "consumer"}
"""Subpackages of ``kvevents`` by source folder (pyproject's package-dir mapping)."""


def _cython_include_dir() -> str:
    """A folder where ``cimport kvevents.schemas._fastcodec`` finds ``schemas/_fastcodec.pxd``.

    The package-dir mapping puts ``kvevents.schemas`` in ``schemas/``, which Cython cannot
    know: it looks for ``kvevents/schemas/_fastcodec.pxd`` on its include path. This mirrors
    the package layout with symbolic links under ``build/``.
    """
    root = Path(__file__).resolve().parent
    mirror = root / "build" / "cython-include" / "kvevents"
    mirror.mkdir(parents=True, exist_ok=True)
    (mirror / "__init__.pxd").touch()
    for name, folder in PACKAGE_DIRS.items():
        link = mirror / name
        if not link.is_symlink():
            link.symlink_to(root / folder, target_is_directory=True)
    return str(mirror.parent)


def _extensions() -> list[Extension]:
    sources = [(name, path) for name, path in EXTENSIONS if Path(path).exists()]
    if not sources:
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    modules = [Extension(name, [path], optional=True, extra_compile_args=["-O3"]) for name, path in sources]
    return cythonize(
        modules,
        language_level=3,
        include_path=[_cython_include_dir()],
        compiler_directives={"boundscheck": False, "wraparound": False},
    )


setup(ext_modules=_extensions())
