# trainkit_add_registry(<trainkit target> <registry.hpp> <shard.hpp>): the static library
# trainkit_registry (alias trainkit::registry) of the Trainer types that make_trainer() and
# tk::dispatch choose from, outside `all`, in the compiled mode (trainkit_compiled, made first by
# trainkit_add_compiled: its users get TRAINKIT_COMPILED_LIB). The types are the one list in registry.hpp,
# TRAINKIT_REGISTRY_PRECISIONS (each with every clip of TRAINKIT_REGISTRY_CLIPS): the precisions
# are dealt in order into TRAINKIT_REGISTRY_UNITS translation units (default 1; at most one per
# precision) generated in the build tree, so that a new entry in the list is compiled with no
# other change. Fewer units cost
# less CPU time, since the code the types share compiles once per unit (GCC 12 -O2 here: one
# precision 18.5 s, four 23.8 s, all seven 31.4 s); more build in parallel on many cores. Used
# by trainkit's own CMakeLists.txt and by the installed package (on the installed files), so
# that an install stays header-only and independent of the compiler's ABI.
function(trainkit_add_registry trainkit_target registry_header shard_header)
  if(TARGET trainkit_registry)
    return()
  endif()
  file(READ "${registry_header}" _text)
  if(NOT _text MATCHES "#define TRAINKIT_REGISTRY_PRECISIONS\\(X\\)(([^\n]*\\\\\n)*[^\n]*)")
    message(FATAL_ERROR "trainkit: ${registry_header} has no TRAINKIT_REGISTRY_PRECISIONS(X) list")
  endif()
  string(REGEX MATCHALL "X\\([^()]+\\)" _entries "${CMAKE_MATCH_1}")
  if(NOT _entries)
    message(FATAL_ERROR "trainkit: TRAINKIT_REGISTRY_PRECISIONS in ${registry_header} lists no precision")
  endif()
  # A consumer's own variable (normal or cache) wins; without one, the cache entry (default 1).
  # (if(NOT DEFINED): under CMake's old CMP0126, set(CACHE) would hide a normal variable.)
  if(NOT DEFINED TRAINKIT_REGISTRY_UNITS)
    set(TRAINKIT_REGISTRY_UNITS 1 CACHE STRING "Translation units of trainkit::registry (precisions dealt in order)")
  endif()
  if(NOT TRAINKIT_REGISTRY_UNITS MATCHES "^[1-9][0-9]?[0-9]?$")
    message(FATAL_ERROR "trainkit: TRAINKIT_REGISTRY_UNITS must be a count from 1 to 999, not '${TRAINKIT_REGISTRY_UNITS}'")
  endif()
  list(LENGTH _entries _count)
  # Exactly min(units, precisions) units: precision i goes to unit i * units / precisions.
  set(_units ${TRAINKIT_REGISTRY_UNITS})
  if(_units GREATER _count)
    set(_units ${_count})
  endif()
  file(GLOB _stale "${CMAKE_BINARY_DIR}/trainkit_registry/*.cpp")
  set(_sources "")
  set(_unit 0)
  set(_shards "")
  set(_names "")
  set(_index 0)
  foreach(_entry IN LISTS _entries)
    string(REGEX REPLACE "^X\\((.*)\\)$" "\\1" _precision "${_entry}")
    string(STRIP "${_precision}" _precision)
    string(APPEND _shards "TRAINKIT_REGISTRY_SHARD(${_precision})\n")
    list(APPEND _names "${_precision}")
    math(EXPR _index "${_index} + 1")
    math(EXPR _next_unit "${_index} * ${_units} / ${_count}")  # the next precision's unit
    if(NOT _next_unit EQUAL _unit OR _index EQUAL _count)
      list(JOIN _names ", " _names)
      set(_source "${CMAKE_BINARY_DIR}/trainkit_registry/unit_${_unit}.cpp")
      file(CONFIGURE OUTPUT "${_source}" CONTENT
           "// Generated from TRAINKIT_REGISTRY_PRECISIONS: the registry's shards of ${_names}.\n#include \"${shard_header}\"\n\n${_shards}")
      list(APPEND _sources "${_source}")
      list(REMOVE_ITEM _stale "${_source}")
      math(EXPR _unit "${_unit} + 1")
      set(_shards "")
      set(_names "")
    endif()
  endforeach()
  if(_stale)
    file(REMOVE ${_stale})  # units of an earlier, longer list or another unit count
  endif()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${registry_header}")
  add_library(trainkit_registry STATIC EXCLUDE_FROM_ALL ${_sources})
  add_library(trainkit::registry ALIAS trainkit_registry)
  # The list's file, for checks that count its entries (tests/downstream/consumer.cmake).
  set_property(TARGET trainkit_registry PROPERTY TRAINKIT_REGISTRY_HEADER "${registry_header}")
  # In the compiled mode, as its users then are: one mode for every file of a program.
  target_link_libraries(trainkit_registry PUBLIC ${trainkit_target} trainkit_compiled)
  # Its users see the registered types as explicit instantiation declarations (dispatch.hpp,
  # which the umbrella header includes): a program compiles their members once, here, not in each
  # file that dispatches or names one.
  target_compile_definitions(trainkit_registry INTERFACE TRAINKIT_EXTERN_TRAINERS)
endfunction()
