"""The native kernel: building it (build.py) and loading it with ctypes (loader.py).

Importing this package compiles nothing; the library is built on the first ``load()``.
"""
from .build import NativeBuildError, NoCompilerError
from .loader import (AbHyper, AbTensor, Native, backend_name, compiled_isas, compiler_description,
                     detected_isa, isa_name, l2_cache_bytes, library_path, load, native_or_none,
                     num_threads, set_num_threads, supported_isas)

__all__ = ["AbHyper", "AbTensor", "Native", "NativeBuildError", "NoCompilerError", "backend_name",
           "compiled_isas", "compiler_description", "detected_isa", "isa_name", "l2_cache_bytes",
           "library_path", "load", "native_or_none", "num_threads", "set_num_threads",
           "supported_isas"]
