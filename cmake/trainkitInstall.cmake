# Install rules and the relocatable CMake package: headers under include/, the package under
# share/cmake/trainkit (trainkit is header-only, so nothing in it depends on the architecture).
include(CMakePackageConfigHelpers)

set(TRAINKIT_INSTALL_CMAKEDIR "${CMAKE_INSTALL_DATADIR}/cmake/trainkit" CACHE STRING
    "Where trainkitConfig.cmake is installed, relative to the prefix")

install(DIRECTORY "${PROJECT_SOURCE_DIR}/include/" DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.hpp" PATTERN "*.h")

install(TARGETS trainkit EXPORT trainkitTargets)
install(FILES "${PROJECT_SOURCE_DIR}/LICENSE" DESTINATION "${CMAKE_INSTALL_DATADIR}/doc/trainkit")
# trainkit-plot: a run's curves from its JSON-lines log as SVG (Python's standard library only):
# nothing to build, so it comes with the package in every mode, the header-only one included.
# (trainkit-config and trainkit-weights are programs: TRAINKIT_BUILD_TOOLS, the `package` preset.)
install(PROGRAMS "${PROJECT_SOURCE_DIR}/tools/trainkit-plot" DESTINATION "${CMAKE_INSTALL_BINDIR}")

# The registry's shard as a source: the package builds trainkit::registry from it on demand.
install(FILES "${PROJECT_SOURCE_DIR}/src/registry/shard.hpp" DESTINATION "${CMAKE_INSTALL_DATADIR}/trainkit/registry")
install(FILES "${CMAKE_CURRENT_LIST_DIR}/trainkitRegistry.cmake" DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")
# The compiled mode's source: the package builds trainkit::compiled from it on demand.
install(FILES "${PROJECT_SOURCE_DIR}/src/trainkit.cpp" DESTINATION "${CMAKE_INSTALL_DATADIR}/trainkit/compiled")
install(FILES "${CMAKE_CURRENT_LIST_DIR}/trainkitCompiled.cmake" DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")
install(EXPORT trainkitTargets NAMESPACE trainkit:: DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")

# trainkit::yaml in its own export set: the package loads it only where libyaml is found, so an
# install made with YAML still serves a consumer without libyaml.
if(TARGET trainkit_yaml)
  install(TARGETS trainkit_yaml EXPORT trainkitYamlTargets)
  install(FILES "${CMAKE_CURRENT_LIST_DIR}/trainkitFindLibYaml.cmake" DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")
  install(EXPORT trainkitYamlTargets NAMESPACE trainkit:: DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")
endif()

configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/trainkitConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/trainkitConfig.cmake"
  INSTALL_DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/trainkitConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}" COMPATIBILITY SameMajorVersion ARCH_INDEPENDENT)
install(FILES "${PROJECT_BINARY_DIR}/trainkitConfig.cmake"
              "${PROJECT_BINARY_DIR}/trainkitConfigVersion.cmake"
        DESTINATION "${TRAINKIT_INSTALL_CMAKEDIR}")
