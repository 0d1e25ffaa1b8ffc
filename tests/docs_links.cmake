# Fails when a source, a script or a document names a Markdown file, a header or a heading of
# benchmarks/RESULTS.md that is not in the repository (headers and headings: see below):
# every `<name>.md` in include/, src/, examples/, tests/, tools/, benchmarks/,
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

set(missing "")
set(checked 0)
foreach(f IN LISTS files)
  if(NOT EXISTS "${ROOT}/${f}" OR IS_DIRECTORY "${ROOT}/${f}")
    continue()
  endif()
  file(READ "${ROOT}/${f}" text)
  get_filename_component(here "${f}" DIRECTORY)
  string(REGEX MATCHALL "(://|[$}{])?[A-Za-z0-9_./-]*[A-Za-z0-9_]\\.md" found "${text}")
  if(NOT f MATCHES "^(tests/layering/|CHANGELOG\\.md$)")
    string(REGEX MATCHALL "[$}{@-]?[A-Za-z0-9_./-]*[A-Za-z0-9_]\\.hpp" found_headers "${text}")
    list(APPEND found ${found_headers})
  endif()
  foreach(ref IN LISTS found)
    # A URL's path, a path built from a variable ($DIR/x.md, ${DIR}/x.md, @VAR@/x.hpp), a file a
    # program writes (under build/, output/, or the device tool's files_at/), another project's
    # header: not the repository's.
    if(ref MATCHES "^(://|[$}{@-])" OR ref MATCHES "^(\\./)?(build|output|files_at)/"
       OR ref MATCHES "^(torch|c10|ATen|nlohmann|doctest)/" OR ref MATCHES "^(json|ProcessGroupGloo)\\.hpp$")
      continue()
    endif()
    math(EXPR checked "${checked} + 1")
    if(ref MATCHES "\\.hpp$")
      set(roots "${ROOT}/include/trainkit" "${ROOT}/include" "${ROOT}" "${ROOT}/${here}")
      set(known ${header_names})
    else()
      set(roots "${ROOT}" "${ROOT}/${here}" "${ROOT}/docs")
      set(known ${names})
    endif()
    if(NOT ref MATCHES "/")  # a bare name: beside the naming file, or any of the repository's
      set(roots "${ROOT}/${here}")
      if(ref IN_LIST known)
        continue()
      endif()
    endif()
    set(found_it FALSE)
    foreach(r IN LISTS roots)
      if(EXISTS "${r}/${ref}")
        set(found_it TRUE)
      endif()
    endforeach()
    if(NOT found_it)
      list(APPEND missing "${f}: ${ref}")
    endif()
  endforeach()
endforeach()

# Results: a citation of benchmarks/RESULTS.md by heading, "<topic>" or "<topic> / <sub-heading>",
# names a `## <topic>` and a `### <sub-heading>` under it; none cites it by a section number.
file(STRINGS "${ROOT}/benchmarks/RESULTS.md" result_headings REGEX "^##")
set(topic "")
set(topics "")
foreach(h IN LISTS result_headings)
  if(h MATCHES "^## (.+)$")
    set(topic "${CMAKE_MATCH_1}")
    list(APPEND topics "${topic}")
  elseif(h MATCHES "^### (.+)$")
    list(APPEND topics "${topic} / ${CMAKE_MATCH_1}")
  endif()
endforeach()
foreach(f IN LISTS files)
  if(f STREQUAL "benchmarks/RESULTS.md" OR NOT EXISTS "${ROOT}/${f}" OR IS_DIRECTORY "${ROOT}/${f}")
    continue()
  endif()
  file(READ "${ROOT}/${f}" text)
  if(NOT text MATCHES "RESULTS\\.md")
    continue()
  endif()
  # (and never by a section number: RESULTS.md has none)
  string(REGEX MATCHALL "RESULTS\\.md[^.;)\n]*sections?[ \t\n#]+[0-9]+" numbered "${text}")
  foreach(n IN LISTS numbered)
    string(REGEX REPLACE "[ \t\n#]+" " " n "${n}")
    list(APPEND missing "${f}: '${n}' (cite RESULTS.md by its headings: Topic / Sub-heading, quoted)")
  endforeach()
  string(REGEX MATCHALL "\"[A-Z][^\"\n]* / [^\"\n]+\"" cited "${text}")
  foreach(c IN LISTS cited)
    string(REGEX REPLACE "^\"(.*)\"$" "\\1" c "${c}")
    math(EXPR checked "${checked} + 1")
    if(NOT c IN_LIST topics)
      list(APPEND missing "${f}: benchmarks/RESULTS.md \"${c}\" (no such heading)")
    endif()
  endforeach()
endforeach()

list(REMOVE_DUPLICATES missing)
if(missing)
  list(JOIN missing "\n  " shown)
  message(FATAL_ERROR "Markdown files or headers named but not in the repository (cite docs/ pages and headers by their real paths):\n  ${shown}")
endif()
message(STATUS "${checked} references to Markdown files, headers and RESULTS.md headings, every one there")
