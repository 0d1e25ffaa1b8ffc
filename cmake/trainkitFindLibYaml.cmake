# libyaml (the C YAML parser PyYAML uses; Debian: libyaml-dev) as the imported target
# trainkit::libyaml, for trainkit::yaml. Sets TRAINKIT_LIBYAML_FOUND. Used by the source tree and
# by the installed package (trainkitConfig.cmake), so that a consumer finds it the same way.
if(NOT TARGET trainkit::libyaml)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND)
    pkg_check_modules(TRAINKIT_PC_LIBYAML QUIET yaml-0.1)
  endif()
  find_path(TRAINKIT_LIBYAML_INCLUDE_DIR yaml.h HINTS ${TRAINKIT_PC_LIBYAML_INCLUDE_DIRS})
  find_library(TRAINKIT_LIBYAML_LIBRARY NAMES yaml libyaml HINTS ${TRAINKIT_PC_LIBYAML_LIBRARY_DIRS})
  mark_as_advanced(TRAINKIT_LIBYAML_INCLUDE_DIR TRAINKIT_LIBYAML_LIBRARY)
  if(TRAINKIT_LIBYAML_INCLUDE_DIR AND TRAINKIT_LIBYAML_LIBRARY)
    add_library(trainkit::libyaml UNKNOWN IMPORTED)
    set_target_properties(trainkit::libyaml PROPERTIES
      IMPORTED_LOCATION "${TRAINKIT_LIBYAML_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${TRAINKIT_LIBYAML_INCLUDE_DIR}")
  endif()
endif()
if(TARGET trainkit::libyaml)
  set(TRAINKIT_LIBYAML_FOUND TRUE)
else()
  set(TRAINKIT_LIBYAML_FOUND FALSE)
endif()
