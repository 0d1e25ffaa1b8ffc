# Finds LibTorch for trainkit's own build (consumers of an installed trainkit get Torch through
# find_dependency in trainkitConfig.cmake instead).
#
# Order: a `torch` target that already exists (the parent project found Torch), then Torch_DIR /
# CMAKE_PREFIX_PATH, then the torch wheel in <trainkit>/.venv that scripts/setup installs.
#
# A CUDA build of LibTorch (the pinned wheel is one) enables the CUDA language while it is found
# and needs the CUDA toolkit (nvcc, cudart) even on a machine without a GPU; its default
# architecture list, found by probing the GPU, falls back to one that includes sm_50, which
# CUDA 13's nvcc no longer compiles. TORCH_CUDA_ARCH_LIST therefore defaults to 9.0 (H100/H200);
# set it (variable or environment) to build CUDA code for other GPUs.
# LibTorch warns that it ignores CMAKE_CUDA_ARCHITECTURES: expected, CMake sets that variable
# itself when the CUDA language is enabled.
if(TARGET torch)
  return()
endif()

if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "9.0" CACHE STRING
      "CUDA architectures for CUDA code built against LibTorch (9.0: H100/H200)")
endif()

# nvcc is often installed without being on PATH; LibTorch's enable_language(CUDA) needs it.
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(TRAINKIT_NVCC nvcc
               HINTS ENV CUDA_HOME ENV CUDA_PATH PATH_SUFFIXES bin
               PATHS /usr/local/cuda/bin)
  if(TRAINKIT_NVCC)
    set(CMAKE_CUDA_COMPILER "${TRAINKIT_NVCC}" CACHE FILEPATH "CUDA compiler (for LibTorch's CUDA package)")
  endif()
endif()

find_package(Torch QUIET)
if(NOT Torch_FOUND)
  set(_trainkit_venv_python "${CMAKE_CURRENT_LIST_DIR}/../.venv/bin/python")
  if(EXISTS "${_trainkit_venv_python}")
    execute_process(
      COMMAND "${_trainkit_venv_python}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
      OUTPUT_VARIABLE _trainkit_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _trainkit_python_status ERROR_QUIET)
    if(_trainkit_python_status EQUAL 0 AND IS_DIRECTORY "${_trainkit_torch_prefix}")
      message(STATUS "trainkit: LibTorch from .venv: ${_trainkit_torch_prefix}")
      find_package(Torch QUIET PATHS "${_trainkit_torch_prefix}" NO_DEFAULT_PATH)
    endif()
  endif()
endif()
if(NOT Torch_FOUND)
  message(FATAL_ERROR
    "trainkit: LibTorch (Torch's CMake package) not found. Run scripts/setup, which installs the "
    "pinned torch wheel into .venv, or give its location: "
    "-DCMAKE_PREFIX_PATH=\"$(python3 -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')\" "
    "or -DTorch_DIR=<libtorch>/share/cmake/Torch.")
endif()
message(STATUS "trainkit: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
