# What every downstream project does once it has trainkit (find_package, add_subdirectory or
# FetchContent): the program tests/downstream/main.cpp linked to trainkit::trainkit (and
# trainkit::yaml where it exists; with TRAINKIT_DOWNSTREAM_COMPILED, in the compiled mode:
# trainkit::compiled, built from the package's source, with trainkit::precompiled's header), and a check that trainkit::registry is defined with a shard
# for each precision of registry.hpp's list (built only when linked: they take a minute here).
set(TRAINKIT_DOWNSTREAM_MAIN "${CMAKE_CURRENT_LIST_DIR}/main.cpp" CACHE FILEPATH "The program")

add_executable(downstream "${TRAINKIT_DOWNSTREAM_MAIN}")
if(TARGET trainkit::yaml)
  target_link_libraries(downstream PRIVATE trainkit::yaml)
else()
  target_link_libraries(downstream PRIVATE trainkit::trainkit)
endif()

option(TRAINKIT_DOWNSTREAM_COMPILED "Build the program in the compiled mode (trainkit::compiled)" OFF)
if(TRAINKIT_DOWNSTREAM_COMPILED)
  if(NOT TARGET trainkit::compiled)
    message(FATAL_ERROR "trainkit::compiled is not defined")
  endif()
  target_link_libraries(downstream PRIVATE trainkit::compiled)
  # And the precompiled header, as the README advises with it (built in this project's tree).
  if(NOT TARGET trainkit::precompiled)
    message(FATAL_ERROR "trainkit::precompiled is not defined")
  endif()
  target_link_libraries(downstream PRIVATE trainkit::precompiled)
  # Where Gloo's headers are found, the data-parallel layer is compiled in the library too.
  get_target_property(_compiled_definitions trainkit::compiled INTERFACE_COMPILE_DEFINITIONS)
  if(TRAINKIT_GLOO_INCLUDE_DIR AND NOT "TRAINKIT_COMPILED_PARALLEL" IN_LIST _compiled_definitions)
    message(FATAL_ERROR "trainkit::compiled found Gloo's headers (${TRAINKIT_GLOO_INCLUDE_DIR}) but does not "
                        "give its users TRAINKIT_COMPILED_PARALLEL: ${_compiled_definitions}")
  endif()
endif()

if(NOT TARGET trainkit::registry)
  message(FATAL_ERROR "trainkit::registry is not defined")
endif()
get_target_property(_registry_sources trainkit::registry SOURCES)
set(_registry_shards 0)
foreach(_source IN LISTS _registry_sources)
  file(STRINGS "${_source}" _lines REGEX "^TRAINKIT_REGISTRY_SHARD\\(")
  list(LENGTH _lines _count)
  math(EXPR _registry_shards "${_registry_shards} + ${_count}")
endforeach()
# As many as registry.hpp's list has entries, counted here from the file itself.
get_target_property(_registry_header trainkit::registry TRAINKIT_REGISTRY_HEADER)
file(READ "${_registry_header}" _registry_text)
if(NOT _registry_text MATCHES "#define TRAINKIT_REGISTRY_PRECISIONS\\(X\\)(([^\n]*\\\\\n)*[^\n]*)")
  message(FATAL_ERROR "${_registry_header} has no TRAINKIT_REGISTRY_PRECISIONS(X) list")
endif()
string(REGEX MATCHALL "X\\([^()]+\\)" _registry_entries "${CMAKE_MATCH_1}")
list(LENGTH _registry_entries _registry_precisions)
if(_registry_precisions LESS 1 OR NOT _registry_shards EQUAL _registry_precisions)
  message(FATAL_ERROR "trainkit::registry's sources (${_registry_sources}) instantiate ${_registry_shards} "
                      "precisions' shards, expected the ${_registry_precisions} of ${_registry_header}")
endif()
