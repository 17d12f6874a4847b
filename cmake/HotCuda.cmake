# CUDA backend configuration: the one place that decides whether CUDA is built, for which
# architectures, and where CUTLASS and cuBLAS come from.
#
# Sets HOT_WITH_CUDA (ON/OFF), HOT_NO_CUDA_REASON, and, when ON, the static library target hot_cuda
# (and, with HOT_BUILD_BENCHMARKS, the benchmark binary hot_bench).
#
# HOT_CUDA_ARCHS: the CUDA architectures, one variable for the whole build ("80;86;89;90a").
#   Default: the visible GPU's arch, else 80;86;89;90a. Each entry becomes
#   -gencode=arch=compute_X,code=sm_X (the form that assembles sm_90a wgmma with nvcc 13.0).
#   Arch-specific sources: cpp/src/cuda/*_sm90.cu only for 90a, cpp/src/cuda/*_sm80.cu only for
#   80/86/89; everything else for every listed arch.
# HOT_CUTLASS_DIR: a CUTLASS include directory (the one holding cutlass/cutlass.h) or a checkout root.
#   Default: third_party/cutlass when checked out, else the nvidia-cutlass Python wheel.

set(HOT_WITH_CUDA OFF)
set(HOT_NO_CUDA_REASON "")
if(HOT_CUDA STREQUAL "OFF")
  set(HOT_NO_CUDA_REASON "built with HOT_CUDA=OFF")
  return()
endif()

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(HOT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "HOT_CUDA=ON but no CUDA compiler was found (set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
  endif()
  set(HOT_NO_CUDA_REASON "no CUDA toolkit (nvcc) was found when hot was built")
  return()
endif()

# Architectures -------------------------------------------------------------------------------------
set(HOT_CUDA_ARCHS "" CACHE STRING "CUDA architectures to build (e.g. 80;86;89;90a); empty = visible GPU, else 80;86;89;90a")
if(NOT HOT_CUDA_ARCHS)
  execute_process(COMMAND nvidia-smi --query-gpu=compute_cap --format=csv,noheader
                  OUTPUT_VARIABLE _hot_cc RESULT_VARIABLE _hot_smi ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_hot_smi EQUAL 0 AND _hot_cc)
    string(REGEX MATCH "^[0-9]+\\.[0-9]+" _hot_cc "${_hot_cc}")
    string(REPLACE "." "" _hot_cc "${_hot_cc}")
    if(_hot_cc STREQUAL "90")
      set(_hot_cc "90a")
    endif()
    set(HOT_CUDA_ARCHS "${_hot_cc}")
  else()
    set(HOT_CUDA_ARCHS "80;86;89;90a")
  endif()
endif()

# Arch flags are passed explicitly (-gencode per arch), so CMake adds none of its own.
set(CMAKE_CUDA_ARCHITECTURES OFF)
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
find_package(CUDAToolkit REQUIRED)

set(_hot_all_gencode "")
set(_hot_sm80_gencode "")
set(_hot_sm90_gencode "")
set(_hot_has_sm80 OFF)
set(_hot_has_sm90a OFF)
foreach(_a IN LISTS HOT_CUDA_ARCHS)
  string(REGEX REPLACE "-(real|virtual)$" "" _a "${_a}")
  if(NOT _a MATCHES "^[0-9]+[a-z]?$")
    message(FATAL_ERROR "HOT_CUDA_ARCHS: cannot parse architecture '${_a}' (expected e.g. 80, 86, 89, 90a)")
  endif()
  set(_g "-gencode=arch=compute_${_a},code=sm_${_a}")
  list(APPEND _hot_all_gencode "${_g}")
  if(_a STREQUAL "80" OR _a STREQUAL "86" OR _a STREQUAL "89")
    list(APPEND _hot_sm80_gencode "${_g}")
    set(_hot_has_sm80 ON)
  elseif(_a STREQUAL "90a")
    list(APPEND _hot_sm90_gencode "${_g}")
    set(_hot_has_sm90a ON)
  elseif(_a STREQUAL "90")
    message(WARNING "HOT_CUDA_ARCHS contains 90 without the 'a' suffix: the wgmma GEMM needs 90a and is not built; "
                    "Hopper GPUs will use the generic integer GEMM")
  endif()
endforeach()
message(STATUS "hot: CUDA architectures: ${HOT_CUDA_ARCHS} (sm80 s4 CUTLASS 2.x GEMM: ${_hot_has_sm80}, "
               "sm90a wgmma CUTLASS 3.x GEMM: ${_hot_has_sm90a})")

# CUTLASS ---------------------------------------------------------------------------------------------
set(HOT_CUTLASS_DIR "" CACHE PATH "CUTLASS include directory (holding cutlass/cutlass.h) or checkout root")
set(_hot_cutlass_inc "")
set(_hot_cutlass_from "")
if(HOT_CUTLASS_DIR)
  if(EXISTS "${HOT_CUTLASS_DIR}/cutlass/cutlass.h")
    set(_hot_cutlass_inc "${HOT_CUTLASS_DIR}")
  elseif(EXISTS "${HOT_CUTLASS_DIR}/include/cutlass/cutlass.h")
    set(_hot_cutlass_inc "${HOT_CUTLASS_DIR}/include")
  elseif(EXISTS "${HOT_CUTLASS_DIR}/source/include/cutlass/cutlass.h")
    set(_hot_cutlass_inc "${HOT_CUTLASS_DIR}/source/include")
  else()
    message(FATAL_ERROR "HOT_CUTLASS_DIR=${HOT_CUTLASS_DIR} holds no cutlass/cutlass.h")
  endif()
  set(_hot_cutlass_from "HOT_CUTLASS_DIR")
elseif(EXISTS "${PROJECT_SOURCE_DIR}/third_party/cutlass/include/cutlass/cutlass.h")
  set(_hot_cutlass_inc "${PROJECT_SOURCE_DIR}/third_party/cutlass/include")
  set(_hot_cutlass_from "git submodule third_party/cutlass")
else()
  if(NOT Python3_EXECUTABLE)
    find_program(Python3_EXECUTABLE NAMES python3 python)
  endif()
  if(Python3_EXECUTABLE)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c "import os, cutlass_library; print(os.path.dirname(cutlass_library.__file__))"
      OUTPUT_VARIABLE _hot_cl_dir RESULT_VARIABLE _hot_cl_rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(_hot_cl_rc EQUAL 0 AND EXISTS "${_hot_cl_dir}/source/include/cutlass/cutlass.h")
      set(_hot_cutlass_inc "${_hot_cl_dir}/source/include")
      set(_hot_cutlass_from "nvidia-cutlass wheel (${_hot_cl_dir})")
    endif()
  endif()
endif()
if(NOT _hot_cutlass_inc)
  string(CONCAT _hot_msg "CUTLASS headers not found: run 'git submodule update --init third_party/cutlass', "
                        "'pip install nvidia-cutlass', or set HOT_CUTLASS_DIR")
  if(HOT_CUDA STREQUAL "ON")
    message(FATAL_ERROR "${_hot_msg}")
  endif()
  set(HOT_NO_CUDA_REASON "${_hot_msg}")
  message(WARNING "hot: CUDA backend disabled: ${HOT_NO_CUDA_REASON}")
  return()
endif()
file(STRINGS "${_hot_cutlass_inc}/cutlass/version.h" _hot_cv REGEX "#define CUTLASS_(MAJOR|MINOR|PATCH) ")
string(REGEX REPLACE ".*CUTLASS_MAJOR ([0-9]+).*CUTLASS_MINOR ([0-9]+).*CUTLASS_PATCH ([0-9]+).*" "\\1.\\2.\\3"
       HOT_CUTLASS_VERSION "${_hot_cv}")
message(STATUS "hot: CUTLASS ${HOT_CUTLASS_VERSION} headers from ${_hot_cutlass_from}: ${_hot_cutlass_inc}")

# cuBLAS ------------------------------------------------------------------------------------------------
# HOT_CUBLAS_SOURCE: AUTO (default) prefers the nvidia-cublas wheel of the Python environment hot is built
# for, because that is the one PyTorch and JAX load: one libcublas.so.13 in the process whatever the import
# order. Else the CUDA toolkit's. TOOLKIT / WHEEL force one.
set(HOT_CUBLAS_SOURCE AUTO CACHE STRING "Where cuBLAS comes from: AUTO, WHEEL or TOOLKIT")
set(_hot_cublas_from "")
if(NOT HOT_CUBLAS_SOURCE STREQUAL "TOOLKIT")
  set(_hot_py "${Python_EXECUTABLE}")
  if(NOT _hot_py)
    set(_hot_py "${Python3_EXECUTABLE}")
  endif()
  if(NOT _hot_py)
    find_program(_hot_py NAMES python3 python)
  endif()
  execute_process(
    COMMAND "${_hot_py}" -c "import site, sys; print(';'.join(site.getsitepackages() + [site.getusersitepackages()]))"
    OUTPUT_VARIABLE _hot_sp ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(_hot_cublas_hints "")
  foreach(_sp IN LISTS _hot_sp)
    list(APPEND _hot_cublas_hints "${_sp}/nvidia/cu13" "${_sp}/nvidia/cublas")
  endforeach()
  find_path(HOT_CUBLAS_INCLUDE_DIR cublas_v2.h HINTS ${_hot_cublas_hints} PATH_SUFFIXES include NO_DEFAULT_PATH)
  find_library(HOT_CUBLAS_LIBRARY NAMES cublas libcublas.so.13 HINTS ${_hot_cublas_hints} PATH_SUFFIXES lib NO_DEFAULT_PATH)
  find_library(HOT_CUBLASLT_LIBRARY NAMES cublasLt libcublasLt.so.13 HINTS ${_hot_cublas_hints} PATH_SUFFIXES lib
               NO_DEFAULT_PATH)
  if(HOT_CUBLAS_INCLUDE_DIR AND HOT_CUBLAS_LIBRARY AND HOT_CUBLASLT_LIBRARY)
    add_library(hot_cublas INTERFACE)
    target_include_directories(hot_cublas INTERFACE ${HOT_CUBLAS_INCLUDE_DIR})
    target_link_libraries(hot_cublas INTERFACE ${HOT_CUBLAS_LIBRARY} ${HOT_CUBLASLT_LIBRARY})
    set(_hot_cublas_libs hot_cublas)
    set(_hot_cublas_from "nvidia-cublas wheel (${HOT_CUBLAS_LIBRARY})")
  elseif(HOT_CUBLAS_SOURCE STREQUAL "WHEEL")
    message(FATAL_ERROR "HOT_CUBLAS_SOURCE=WHEEL but no nvidia-cublas wheel was found for ${_hot_py}")
  endif()
endif()
if(NOT _hot_cublas_from)
  if(TARGET CUDA::cublas AND TARGET CUDA::cublasLt)
    set(_hot_cublas_libs CUDA::cublas CUDA::cublasLt)
    set(_hot_cublas_from "CUDA toolkit")
  else()
    set(_hot_msg "cuBLAS not found in the nvidia-cublas wheel nor in the CUDA toolkit")
    if(HOT_CUDA STREQUAL "ON")
      message(FATAL_ERROR "${_hot_msg}")
    endif()
    set(HOT_NO_CUDA_REASON "${_hot_msg}")
    message(WARNING "hot: CUDA backend disabled: ${HOT_NO_CUDA_REASON}")
    return()
  endif()
endif()
# The CUDA runtime is linked statically: a private copy that shares the driver's primary context (and so
# streams and the default memory pool) with the framework's runtime, without clashing with its
# libcudart.so of another minor version.
option(HOT_CUDART_STATIC "Link the CUDA runtime statically" ON)
if(HOT_CUDART_STATIC)
  set(_hot_cudart CUDA::cudart_static)
else()
  set(_hot_cudart CUDA::cudart)
endif()
message(STATUS "hot: cuBLAS from ${_hot_cublas_from}")

# Targets -------------------------------------------------------------------------------------------------
file(GLOB _hot_cuda_all CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/cpp/src/cuda/*.cu ${PROJECT_SOURCE_DIR}/cpp/src/cuda/*.cpp)
set(_hot_cuda_generic "")
set(_hot_cuda_sm80 "")
set(_hot_cuda_sm90 "")
foreach(_f IN LISTS _hot_cuda_all)
  if(_f MATCHES "_sm90\\.cu$")
    list(APPEND _hot_cuda_sm90 "${_f}")
  elseif(_f MATCHES "_sm80\\.cu$")
    list(APPEND _hot_cuda_sm80 "${_f}")
  else()
    list(APPEND _hot_cuda_generic "${_f}")
  endif()
endforeach()

set(_hot_cuda_common_opts
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-ffp-contract=off>
    # Quantisers use explicit _rn intrinsics; keep nvcc from contracting the rest of the fp32 math too.
    $<$<COMPILE_LANGUAGE:CUDA>:-fmad=false>)
set(_hot_cuda_defs HOT_CUTLASS_VERSION_STR="${HOT_CUTLASS_VERSION}")
string(REPLACE ";" "," _hot_archs_str "${HOT_CUDA_ARCHS}")
list(APPEND _hot_cuda_defs HOT_CUDA_ARCHS_STR="${_hot_archs_str}")
if(_hot_has_sm80)
  list(APPEND _hot_cuda_defs HOT_CUDA_HAS_SM80=1)
endif()
if(_hot_has_sm90a)
  list(APPEND _hot_cuda_defs HOT_CUDA_HAS_SM90A=1)
endif()

function(_hot_cuda_setup tgt gencode)
  set_target_properties(${tgt} PROPERTIES CUDA_ARCHITECTURES OFF POSITION_INDEPENDENT_CODE ON
                                          CUDA_SEPARABLE_COMPILATION OFF)
  target_include_directories(${tgt} PRIVATE ${PROJECT_SOURCE_DIR}/cpp/include ${PROJECT_SOURCE_DIR}/cpp/src)
  target_include_directories(${tgt} SYSTEM PRIVATE ${_hot_cutlass_inc})
  target_compile_options(${tgt} PRIVATE ${_hot_cuda_common_opts} $<$<COMPILE_LANGUAGE:CUDA>:${gencode}>)
  target_compile_definitions(${tgt} PRIVATE ${_hot_cuda_defs})
  target_link_libraries(${tgt} PRIVATE ${_hot_cudart} ${_hot_cublas_libs})
endfunction()

add_library(hot_cuda STATIC ${_hot_cuda_generic})
_hot_cuda_setup(hot_cuda "${_hot_all_gencode}")
if(_hot_has_sm90a AND _hot_cuda_sm90)
  add_library(hot_cuda_sm90 OBJECT ${_hot_cuda_sm90})
  _hot_cuda_setup(hot_cuda_sm90 "${_hot_sm90_gencode}")
  # CUTLASS device asserts would be calls inside the wgmma mainloop (ptxas C7510: serialised wgmma).
  target_compile_definitions(hot_cuda_sm90 PRIVATE NDEBUG)
  target_sources(hot_cuda PRIVATE $<TARGET_OBJECTS:hot_cuda_sm90>)
endif()
if(_hot_has_sm80 AND _hot_cuda_sm80)
  add_library(hot_cuda_sm80 OBJECT ${_hot_cuda_sm80})
  _hot_cuda_setup(hot_cuda_sm80 "${_hot_sm80_gencode}")
  target_sources(hot_cuda PRIVATE $<TARGET_OBJECTS:hot_cuda_sm80>)
endif()
target_link_libraries(hot_cuda PUBLIC ${_hot_cudart} ${_hot_cublas_libs})

set(HOT_WITH_CUDA ON)

# Benchmarks (C++ binary; the Python-level ones live beside it in benchmarks/) ------------------------------
option(HOT_BUILD_BENCHMARKS "Build the CUDA benchmark binary hot_bench" ON)
if(HOT_BUILD_BENCHMARKS AND EXISTS "${PROJECT_SOURCE_DIR}/benchmarks/bench_hot.cu" AND TARGET hot_core)
  add_executable(hot_bench ${PROJECT_SOURCE_DIR}/benchmarks/bench_hot.cu)
  _hot_cuda_setup(hot_bench "${_hot_all_gencode}")
  target_link_libraries(hot_bench PRIVATE hot_core)
endif()
