# trainkit_add_registry(<trainkit target> <source>...): the static library trainkit_registry
# (alias trainkit::registry) from the registry's shards, src/registry/<precision>.cpp, outside
# `all`. Used by trainkit's own CMakeLists.txt and by the installed package (on the installed
# sources), so that an install stays header-only and independent of the compiler's ABI.
function(trainkit_add_registry trainkit_target)
  if(TARGET trainkit_registry)
    return()
  endif()
  add_library(trainkit_registry STATIC EXCLUDE_FROM_ALL ${ARGN})
  add_library(trainkit::registry ALIAS trainkit_registry)
  target_link_libraries(trainkit_registry PUBLIC ${trainkit_target})
endfunction()
