# What every downstream project does once it has trainkit (find_package, add_subdirectory or
# FetchContent): the program tests/downstream/main.cpp linked to trainkit::trainkit (and
# trainkit::yaml where it exists), and a check that trainkit::registry is defined with a shard
# for each of its 7 precisions (built only when linked: they take a minute here).
set(TRAINKIT_DOWNSTREAM_MAIN "${CMAKE_CURRENT_LIST_DIR}/main.cpp" CACHE FILEPATH "The program")

add_executable(downstream "${TRAINKIT_DOWNSTREAM_MAIN}")
if(TARGET trainkit::yaml)
  target_link_libraries(downstream PRIVATE trainkit::yaml)
else()
  target_link_libraries(downstream PRIVATE trainkit::trainkit)
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
if(NOT _registry_shards EQUAL 7)
  message(FATAL_ERROR "trainkit::registry's sources (${_registry_sources}) instantiate ${_registry_shards} "
                      "precisions' shards, expected the 7 of registry.hpp")
endif()
