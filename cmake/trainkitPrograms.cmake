# Programs built inside trainkit's own tree (examples, benchmarks, tools, compile-fail cases):
#
#   trainkit_add_program(<target> SOURCES <file>... [OUTPUT_NAME <name>] [LIBRARIES <lib>...]
#                        [HEADER_ONLY])
#
# makes an executable linked to trainkit::trainkit (and trainkit::yaml where it exists) that
# reuses one precompiled header of <torch/torch.h> and <nlohmann/json.hpp>, compiled once for all
# of them (target trainkit_pch). LibTorch's headers are most of each program's compile time.
# Programs build in the compiled mode (they link trainkit::compiled, built once for all of them:
# a test program compiles in 57-79% of its header-only time, benchmarks/RESULTS.md "Build / Fresh clone and rebuild times");
# HEADER_ONLY keeps a program header-only. The benchmarks are header-only (their figures are the
# header-only build's, every definition visible to the optimiser); so are the downstream
# projects and the compile-fail cases, which test that mode.
# A program that adds compile definitions or options of its own still builds: GCC then ignores
# the precompiled header (-Winvalid-pch says so) and reads the headers.

# Developer-only settings shared by everything built here; not part of trainkit::trainkit.
add_library(trainkit_dev INTERFACE)
if(TARGET trainkit_yaml)
  target_link_libraries(trainkit_dev INTERFACE trainkit_yaml)
else()
  target_link_libraries(trainkit_dev INTERFACE trainkit)
endif()
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(trainkit_dev INTERFACE -Wall -Wextra)
endif()

file(CONFIGURE OUTPUT "${PROJECT_BINARY_DIR}/trainkit_pch.cpp"
     CONTENT "// The translation unit that carries trainkit_pch's precompiled header.\n")
add_library(trainkit_pch OBJECT "${PROJECT_BINARY_DIR}/trainkit_pch.cpp")
target_link_libraries(trainkit_pch PUBLIC trainkit_dev)
target_precompile_headers(trainkit_pch PRIVATE <torch/torch.h> <nlohmann/json.hpp>)

# The compiled mode's unit and the registry's shards get the same flags and reuse the same
# precompiled header.
foreach(_library trainkit_compiled trainkit_registry)
  target_link_libraries(${_library} PRIVATE trainkit_dev)
  target_precompile_headers(${_library} REUSE_FROM trainkit_pch)
endforeach()

function(trainkit_add_program target)
  cmake_parse_arguments(PARSE_ARGV 1 ARG "HEADER_ONLY" "OUTPUT_NAME" "SOURCES;LIBRARIES")
  if(NOT ARG_SOURCES)
    message(FATAL_ERROR "trainkit_add_program(${target}): SOURCES is empty")
  endif()
  add_executable(${target} ${ARG_SOURCES})
  set_property(GLOBAL APPEND PROPERTY TRAINKIT_PROGRAMS ${target})
  target_link_libraries(${target} PRIVATE trainkit_dev ${ARG_LIBRARIES})
  if(NOT ARG_HEADER_ONLY)
    target_link_libraries(${target} PRIVATE trainkit::compiled)
  endif()
  target_precompile_headers(${target} REUSE_FROM trainkit_pch)
  if(ARG_OUTPUT_NAME)
    set_target_properties(${target} PROPERTIES OUTPUT_NAME "${ARG_OUTPUT_NAME}")
  endif()
endfunction()

# Test code (the unit tests, the programs they start, the guide's examples) compiles at -O1 in
# Release builds: it is orchestration around LibTorch's own (optimised) kernels, and -O1 takes a
# quarter less compile time than -O2 (GCC 12, -ftime-report on a test unit: 26.1 s against 34.5).
# Benchmarks and examples keep -O2. The precompiled header (made at -O2) is valid at -O1.
function(trainkit_test_optimization target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE $<$<CONFIG:Release>:-O1>)
  endif()
endfunction()

# Every <dir>/*.cpp becomes the program <prefix><stem> (file <stem> in the build's <dir>/), and
# every <dir>/<sub>/CMakeLists.txt is added with add_subdirectory. Used by examples/ and benchmarks/.
#   trainkit_add_programs_in_directory(<prefix> [HEADER_ONLY])
function(trainkit_add_programs_in_directory prefix)
  if(ARGN AND NOT ARGN STREQUAL "HEADER_ONLY")
    message(FATAL_ERROR "trainkit_add_programs_in_directory(${prefix}): unknown arguments ${ARGN}")
  endif()
  file(GLOB _sources CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/*.cpp")
  foreach(_source IN LISTS _sources)
    get_filename_component(_stem "${_source}" NAME_WE)
    trainkit_add_program(${prefix}${_stem} SOURCES "${_source}" OUTPUT_NAME ${_stem} ${ARGN})
  endforeach()
  file(GLOB _subprojects CONFIGURE_DEPENDS "${CMAKE_CURRENT_SOURCE_DIR}/*/CMakeLists.txt")
  foreach(_listfile IN LISTS _subprojects)
    get_filename_component(_dir "${_listfile}" DIRECTORY)
    add_subdirectory("${_dir}")
  endforeach()
endfunction()
