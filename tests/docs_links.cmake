# Fails when a source, a script or a document names a Markdown file or a header that is not in
# the repository (headers: see below): every `<name>.md` in include/, src/, examples/, tests/, tools/, benchmarks/,
# scripts/, cmake/, docs/, README.md and CHANGELOG.md must be a file. A name with a directory is
# looked up from the repository's root, from the naming file's folder (a link) and from docs/
# (the links of the generated config reference); a bare name in the naming file's folder, then
# among the repository's Markdown files (docs/, examples/, benchmarks/, tests/, tools/, the top).
# Paths built from variables and files that programs write (build/, output/) are not checked. Test docs.links (tests/CMakeLists.txt):
#   cmake -DROOT=<trainkit> -P docs_links.cmake
cmake_minimum_required(VERSION 3.21)
file(GLOB_RECURSE files LIST_DIRECTORIES false RELATIVE "${ROOT}"
     "${ROOT}/include/*" "${ROOT}/src/*" "${ROOT}/examples/*" "${ROOT}/tests/*" "${ROOT}/tools/*"
     "${ROOT}/benchmarks/*" "${ROOT}/scripts/*" "${ROOT}/cmake/*" "${ROOT}/docs/*")
list(APPEND files README.md CHANGELOG.md CMakeLists.txt)
list(FILTER files EXCLUDE REGEX "^tests/fuzz/")  # fuzzing inputs: bytes, not references
file(GLOB markdown LIST_DIRECTORIES false RELATIVE "${ROOT}" "${ROOT}/*.md")
foreach(dir docs examples benchmarks tests tools)
  file(GLOB_RECURSE more LIST_DIRECTORIES false RELATIVE "${ROOT}" "${ROOT}/${dir}/*.md")
  list(APPEND markdown ${more})
endforeach()
set(names "")
foreach(m IN LISTS markdown)
  get_filename_component(n "${m}" NAME)
  list(APPEND names "${n}")
endforeach()

set(missing "")
set(checked 0)
foreach(f IN LISTS files)
  if(NOT EXISTS "${ROOT}/${f}" OR IS_DIRECTORY "${ROOT}/${f}")
    continue()
  endif()
  file(READ "${ROOT}/${f}" text)
  string(REGEX MATCHALL "(://|[$}{])?[A-Za-z0-9_./-]*[A-Za-z0-9_]\\.md" found "${text}")
  get_filename_component(here "${f}" DIRECTORY)
  foreach(ref IN LISTS found)
    # A URL's path, a path built from a variable ($DIR/x.md, ${DIR}/x.md), or a file a program
    # writes (under build/, output/, or the device tool's files_at/): not the repository's.
    if(ref MATCHES "^(://|[$}{])" OR ref MATCHES "^(\\./)?(build|output|files_at)/")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    if(ref MATCHES "/")
      if(EXISTS "${ROOT}/${ref}" OR EXISTS "${ROOT}/${here}/${ref}" OR EXISTS "${ROOT}/docs/${ref}")
        continue()
      endif()
    else()
      if(EXISTS "${ROOT}/${here}/${ref}" OR ref IN_LIST names)
        continue()
      endif()
    endif()
    list(APPEND missing "${f}: ${ref}")
  endforeach()
endforeach()

# Headers: every `<path>.hpp` named (an include, a "see trainkit/fit/fit.hpp", a bare
# "storage.hpp") is a file. A path is looked up from include/trainkit/, include/, the root and the
# naming file's folder; a bare name among the repository's headers. Other projects' headers
# (LibTorch's, nlohmann's ...), paths built from variables, the layering check's fixture and the
# CHANGELOG's past entries (which name headers where they were) are not checked.
file(GLOB_RECURSE headers LIST_DIRECTORIES false RELATIVE "${ROOT}"
     "${ROOT}/include/*.hpp" "${ROOT}/src/*.hpp" "${ROOT}/examples/*.hpp" "${ROOT}/tests/*.hpp"
     "${ROOT}/benchmarks/*.hpp" "${ROOT}/tools/*.hpp")
set(header_names "")
foreach(h IN LISTS headers)
  get_filename_component(n "${h}" NAME)
  list(APPEND header_names "${n}")
endforeach()
set(header_files ${files})
list(FILTER header_files EXCLUDE REGEX "^(tests/layering/|CHANGELOG\\.md$)")
foreach(f IN LISTS header_files)
  if(NOT EXISTS "${ROOT}/${f}" OR IS_DIRECTORY "${ROOT}/${f}")
    continue()
  endif()
  file(READ "${ROOT}/${f}" text)
  string(REGEX MATCHALL "[$}{@-]?[A-Za-z0-9_./-]*[A-Za-z0-9_]\\.hpp" found "${text}")
  get_filename_component(here "${f}" DIRECTORY)
  foreach(ref IN LISTS found)
    if(ref MATCHES "^[$}{@-]" OR ref MATCHES "^(torch|c10|ATen|nlohmann|doctest)/" OR ref MATCHES "^(\\./)?(build|output)/"
       OR ref MATCHES "^(json|ProcessGroupGloo)\\.hpp$")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    if(ref MATCHES "/")
      if(EXISTS "${ROOT}/include/trainkit/${ref}" OR EXISTS "${ROOT}/include/${ref}" OR EXISTS "${ROOT}/${ref}"
         OR EXISTS "${ROOT}/${here}/${ref}")
        continue()
      endif()
    elseif(ref IN_LIST header_names)
      continue()
    endif()
    list(APPEND missing "${f}: ${ref}")
  endforeach()
endforeach()

list(REMOVE_DUPLICATES missing)
if(missing)
  list(JOIN missing "\n  " shown)
  message(FATAL_ERROR "Markdown files or headers named but not in the repository (cite docs/ pages and headers by their real paths):\n  ${shown}")
endif()
message(STATUS "${checked} references to Markdown files and headers, every one a file")
