# trainkit_add_registry(<trainkit target> <registry.hpp> <shard.hpp>): the static library
# trainkit_registry (alias trainkit::registry) of the Trainer types that make_trainer() and
# tk::dispatch choose from, outside `all`. The types are the one list in registry.hpp,
# TRAINKIT_REGISTRY_PRECISIONS (each with every clip of TRAINKIT_REGISTRY_CLIPS): one
# translation unit per precision is generated from it in the build tree, so that they compile
# in parallel and a new entry in the list is a new shard. Used by trainkit's own CMakeLists.txt
# and by the installed package (on the installed files), so that an install stays header-only
# and independent of the compiler's ABI.
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
  set(_sources "")
  foreach(_entry IN LISTS _entries)
    string(REGEX REPLACE "^X\\((.*)\\)$" "\\1" _precision "${_entry}")
    string(STRIP "${_precision}" _precision)
    string(MAKE_C_IDENTIFIER "${_precision}" _stem)
    set(_source "${CMAKE_BINARY_DIR}/trainkit_registry/${_stem}.cpp")
    file(CONFIGURE OUTPUT "${_source}" CONTENT
         "// Generated from TRAINKIT_REGISTRY_PRECISIONS: the registry's ${_precision} shard.\n#include \"${shard_header}\"\n\nTRAINKIT_REGISTRY_SHARD(${_precision})\n")
    list(APPEND _sources "${_source}")
  endforeach()
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${registry_header}")
  add_library(trainkit_registry STATIC EXCLUDE_FROM_ALL ${_sources})
  add_library(trainkit::registry ALIAS trainkit_registry)
  target_link_libraries(trainkit_registry PUBLIC ${trainkit_target})
endfunction()
