# Registers the downstream tests (included from tests/CMakeLists.txt). Each builds a project of
# tests/downstream/ with this build's compiler, launcher, build type and packages (settings in
# downstream-init.cmake, given with -C), from scratch, and runs its program `downstream`:
#   downstream.install         cmake --install this build into downstream/prefix (fixture)
#   downstream.install_unbuilt cmake --install of a freshly configured, unbuilt tree
#   downstream.unit_counts     the registry's and the tests' unit counts, as configured
#   downstream.find_package    find_package(trainkit CONFIG REQUIRED) against that prefix
#   downstream.add_subdirectory / downstream.fetchcontent   the source tree itself
# find_package builds the program in the compiled mode (trainkit::compiled from the installed
# source), the other two header-only.
# The projects compile tests/downstream/main.cpp; another program can be given to any of them with
# -DTRAINKIT_DOWNSTREAM_MAIN=<file>.
set(_here "${CMAKE_CURRENT_SOURCE_DIR}/downstream")
set(_work "${CMAKE_CURRENT_BINARY_DIR}/downstream")
set(_prefix "${_work}/prefix")

# LibTorch's CMake prefix: Torch_DIR is <prefix>/Torch.
get_filename_component(_torch_prefix "${Torch_DIR}/.." ABSOLUTE)
set(_init "")
foreach(_var CMAKE_BUILD_TYPE CMAKE_CXX_COMPILER CMAKE_CXX_COMPILER_LAUNCHER CMAKE_CXX_FLAGS
             CMAKE_CXX_FLAGS_RELEASE CMAKE_CXX_FLAGS_DEBUG CMAKE_CXX_FLAGS_RELWITHDEBINFO
             CMAKE_MAKE_PROGRAM CMAKE_CUDA_COMPILER TORCH_CUDA_ARCH_LIST)
  if(DEFINED ${_var})
    string(APPEND _init "set(${_var} [==[${${_var}}]==] CACHE STRING \"\")\n")
  endif()
endforeach()
string(APPEND _init "set(CMAKE_PREFIX_PATH [==[${_prefix};${CMAKE_PREFIX_PATH};${_torch_prefix}]==] CACHE STRING \"\")\n")
file(CONFIGURE OUTPUT "${_work}/downstream-init.cmake" CONTENT "${_init}")

set(_driver "${_here}/build_and_run.cmake")
set(_expect "trainkit ${PROJECT_VERSION}, tensor sum 6, applied 1")
if(TARGET trainkit_yaml)
  string(APPEND _expect ", yaml 42")
endif()

add_test(NAME downstream.install
         COMMAND "${CMAKE_COMMAND}" "-DINSTALL_FROM=${PROJECT_BINARY_DIR}" "-DPREFIX=${_prefix}"
                 -P "${_driver}")
set_tests_properties(downstream.install PROPERTIES
  LABELS downstream FIXTURES_SETUP trainkit_installed)

function(trainkit_add_downstream_test way)
  add_test(NAME downstream.${way}
           COMMAND "${CMAKE_COMMAND}" "-DSOURCE_DIR=${_here}/${way}" "-DBINARY_DIR=${_work}/${way}"
                   "-DINIT_CACHE=${_work}/downstream-init.cmake" "-DEXPECT=${_expect}" ${ARGN}
                   "-DGENERATOR=${CMAKE_GENERATOR}" -P "${_driver}")
  set_tests_properties(downstream.${way} PROPERTIES
    LABELS downstream RESOURCE_LOCK ${TRAINKIT_COMPILE_LOCK} TIMEOUT 1800)
endfunction()

trainkit_add_downstream_test(find_package "-DEXPECT_TRAINKIT_DIR=${_prefix}/"
                             "-DEXTRA_ARGS=-DTRAINKIT_DOWNSTREAM_COMPILED=ON" "-DEXPECT=${_expect}, compiled mode")
set_tests_properties(downstream.find_package PROPERTIES FIXTURES_REQUIRED trainkit_installed)
trainkit_add_downstream_test(add_subdirectory "-DEXTRA_ARGS=-DTRAINKIT_SOURCE_DIR=${PROJECT_SOURCE_DIR}")
trainkit_add_downstream_test(fetchcontent "-DEXTRA_ARGS=-DFETCHCONTENT_SOURCE_DIR_TRAINKIT=${PROJECT_SOURCE_DIR}")

add_test(NAME downstream.install_unbuilt
         COMMAND "${CMAKE_COMMAND}" "-DSOURCE=${PROJECT_SOURCE_DIR}" "-DWORK=${_work}/unbuilt"
                 "-DINIT_CACHE=${_work}/downstream-init.cmake" "-DGENERATOR=${CMAKE_GENERATOR}"
                 -P "${_here}/install_unbuilt.cmake")
set_tests_properties(downstream.install_unbuilt PROPERTIES LABELS downstream TIMEOUT 600)

add_test(NAME downstream.unit_counts
         COMMAND "${CMAKE_COMMAND}" "-DSOURCE=${PROJECT_SOURCE_DIR}" "-DWORK=${_work}/unit_counts"
                 "-DINIT_CACHE=${_work}/downstream-init.cmake" "-DGENERATOR=${CMAKE_GENERATOR}"
                 -P "${_here}/unit_counts.cmake")
set_tests_properties(downstream.unit_counts PROPERTIES LABELS downstream TIMEOUT 600)
