# What every downstream project does once it has trainkit (find_package, add_subdirectory or
# FetchContent): the program tests/downstream/main.cpp linked to trainkit::trainkit (and
# trainkit::yaml where it exists), and a check that trainkit::registry is defined with its
# shards (built only when linked: they take minutes here).
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
list(LENGTH _registry_sources _registry_count)
if(_registry_count LESS 7)
  message(FATAL_ERROR "trainkit::registry has ${_registry_count} sources, expected its 7 shards")
endif()
