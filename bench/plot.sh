#!/bin/sh
# Pause and resume time against GiB, with and without backups, next to the
# same work done in one process: build/bench/pause_resume.png.
#   bench/plot.sh BUILD [BACKEND] [SIZES...]
set -eu
build=$1
backend=${2:-host}
shift $(( $# > 1 ? 2 : 1 ))
sizes=${*:-256M 512M 1G 2G}
chunk=${CHUNK:-64M}
out=$build/bench
mkdir -p "$out"
plain=$out/plot-$backend.dat
backup=$out/plot-$backend-backup.dat
: > "$plain"
: > "$backup"
for s in $sizes; do
  "$build/bench/bench_pause" --backend "$backend" --total "$s" --chunk "$chunk" --rounds 3 \
    --plot "$plain" "$build/bin" 3>/dev/null 2>/dev/null
  "$build/bench/bench_pause" --backend "$backend" --total "$s" --chunk "$chunk" --rounds 3 --backup \
    --plot "$backup" "$build/bin" 3>/dev/null 2>/dev/null
done
command -v gnuplot >/dev/null 2>&1 || { echo "plot: no gnuplot (apt-get install gnuplot-nox)"; exit 0; }
gnuplot <<GP
set terminal pngcairo size 900,560 font ",11"
set output "$out/pause_resume-$backend.png"
set title "gpumemd pause and resume, 4 workers ($backend backend)"
set xlabel "GiB held by the workers"
set ylabel "milliseconds"
set key top left
set grid
plot "$plain" using 1:2 with linespoints lw 2 title "pause", \
     "$plain" using 1:3 with linespoints lw 2 title "resume", \
     "$backup" using 1:2 with linespoints lw 2 title "pause with backup", \
     "$backup" using 1:3 with linespoints lw 2 title "resume with backup", \
     "$plain" using 1:4 with linespoints dt 2 title "baseline pause (one process)", \
     "$plain" using 1:5 with linespoints dt 2 title "baseline resume (one process)", \
     "$backup" using 1:4 with linespoints dt 3 title "baseline pause + plain copy", \
     "$backup" using 1:5 with linespoints dt 3 title "baseline resume + plain copy"
GP
echo "plot: $out/pause_resume-$backend.png"
